"""Chat templates the tests serve or tokenize with."""

from workers.modeling.synthetic import CHAT_TEMPLATE

ALTERNATE = "Conversation roles must alternate user/assistant/user/assistant/..."
# The tiny model's template behind the check many real templates (Llama 2, Mistral) make.
ALTERNATING_TEMPLATE = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('" + ALTERNATE + "') }}{% endif %}{% endfor %}" + CHAT_TEMPLATE
)
