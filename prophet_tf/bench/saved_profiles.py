"""The model profiles shipped in ``prophet_tf/bench/profiles/<model>.json``
(made by ``prophet-tf simulate --profile MODEL``; ``models.profile_model``), and
how a bench run's JSON names the one it used.

A run on a shipped profile (emulated compute, or real compute without a
compute-only run) records a reference, not a copy (30 KB for ResNet-50, in
every run and every suite cell)::

    {"name": "resnet50", "sha256": "<of the file's bytes>", "scale": 0.42}

``scale`` is there when the run's compute times were the profile's times
multiplied by it (:func:`scaled_profile`). :func:`resolve` turns a reference
back into the profile, and refuses one whose file has changed since (git keeps
the old file: ``git log -p -- prophet_tf/bench/profiles/<model>.json``). A
profile measured in the run itself (real compute) is stored whole: it is a
measurement, not a copy.
"""
from __future__ import annotations

import hashlib
import json
import os

__all__ = ["PROFILE_DIR", "profile_path", "load_profile", "save_profile", "scaled_profile",
           "reference", "resolve", "is_reference"]

PROFILE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")


def profile_path(name: str) -> str:
    return os.path.join(PROFILE_DIR, f"{name}.json")


def _path_of(name_or_path: str) -> str:
    path = name_or_path if name_or_path.endswith(".json") else profile_path(name_or_path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"No profile for {name_or_path!r} at {path}; make it with "
                                f"`prophet-tf simulate --profile {name_or_path}`. "
                                f"Received: model={name_or_path!r}")
    return path


def load_profile(name_or_path: str) -> dict:
    """A saved profile, by model name (``prophet_tf/bench/profiles/<name>.json``) or path.

    Raises:
      FileNotFoundError: no such profile; the message says how to make one.
    """
    with open(_path_of(name_or_path)) as f:
        return json.load(f)


def save_profile(profile: dict, command: str, path: str | None = None) -> str:
    """Writes ``profile`` (with the ``command`` that made it) as JSON; returns the path."""
    path = path or profile_path(profile["model"])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({**profile, "command": command}, f, indent=1)
    return path


def scaled_profile(profile: dict, scale: float) -> dict:
    """``profile`` with every compute time multiplied by ``scale`` (what the
    emulated model of it computes; ``prophet_tf.bench.emulated``)."""
    times = ("forward_s", "backward_s", "compute_s", "step_s")
    variables = [{**v, "forward_s": v["forward_s"] * scale,
                  "backward_ready_s": v["backward_ready_s"] * scale}
                 for v in profile["variables"]]
    return {**{k: v for k, v in profile.items() if not k.endswith("_all")},
            **{k: profile[k] * scale for k in times if k in profile},
            "variables": variables, "emulated_scale": scale}


def _sha256(name: str) -> str:
    with open(_path_of(name), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def reference(name: str, scale: float | None = None) -> dict:
    """What a run's JSON records of shipped profile ``name`` (scaled by
    ``scale`` when given)."""
    return {"name": name, "sha256": _sha256(name), **({} if scale is None else {"scale": scale})}


def is_reference(entry) -> bool:
    return isinstance(entry, dict) and "sha256" in entry and "variables" not in entry


def resolve(entry: dict) -> dict:
    """The profile a run's JSON names: ``entry`` itself when it is a whole
    (measured) profile, else the shipped profile it refers to, scaled as the run was.

    Raises:
      ValueError: the shipped profile's bytes are not the ones the run used.
      FileNotFoundError: no such shipped profile.
    """
    if not is_reference(entry):
        return entry
    name, want = entry["name"], entry["sha256"]
    have = _sha256(name)
    if have != want:
        raise ValueError(
            f"the run used profile {name!r} with sha256 {want}, but the shipped "
            f"{profile_path(name)} has sha256 {have}: it changed after the run. The run's "
            f"profile is in git (git log -p -- prophet_tf/bench/profiles/{name}.json)")
    profile = load_profile(name)
    return scaled_profile(profile, entry["scale"]) if "scale" in entry else profile
