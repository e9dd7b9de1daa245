"""The engine and its scheduling: the step loop, scheduler, sampling, stats, its child process, the model gate."""
