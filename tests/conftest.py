"""For every test: with no `model` set, the tiny random model (fast, no real text needed), also in
the processes the tests start (Ray workers, engine children, the CLI). Tests of the real default
model, SmolLM2, set GRAPHSERVE_DEFAULT_MODEL themselves."""

import os

from workers.modeling.default_model import DEFAULT_MODEL_ENV

os.environ[DEFAULT_MODEL_ENV] = "tiny"
