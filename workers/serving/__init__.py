"""The engine and its scheduling: the step, scheduler, sampling, stats, the model gate (the loop that
steps it, in a thread or a child process, is `workers/front/`)."""
