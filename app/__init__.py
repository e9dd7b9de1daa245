"""Ray Serve wiring: `serve run app:deployment` (see app/builder.py).

`deployment` is imported on first use: a replica, the ingress and the controller import modules of
this package, and none of them needs the builder (which imports every deployment's module)."""


def __getattr__(name: str):
    if name == "deployment":
        from app.builder import deployment

        return deployment
    raise AttributeError(f"module 'app' has no attribute {name!r}")


__all__ = ["deployment"]
