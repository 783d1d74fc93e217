"""Profiles for the simulator's tests: a model given by its variables' sizes and timing."""


def toy_profile(nbytes, forward, ready) -> dict:
    """A profile of float32 variables: ``nbytes`` each, ``forward`` seconds of forward
    pass each, and each gradient ready ``ready`` seconds into the backward pass."""
    variables = [{"name": f"v{i}", "shape": [b // 4], "nbytes": b, "forward_s": f,
                  "backward_ready_s": r} for i, (b, f, r) in enumerate(zip(nbytes, forward, ready))]
    return {"model": "toy", "variables": variables, "forward_s": sum(forward),
            "backward_s": max(ready), "compute_s": sum(forward) + max(ready)}


# A small CNN-like model: small early layers with most compute, big late layers.
TOY = toy_profile([40_000, 400_000, 4_000_000, 40_000], [0.02, 0.02, 0.005, 0.001],
                  [0.08, 0.05, 0.01, 0.002])
