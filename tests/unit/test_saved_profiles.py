"""A bench run's JSON names the shipped profile it ran on (name, sha256, scale)
instead of carrying a copy, and the name resolves to exactly what ran."""
import glob
import hashlib
import json
import pathlib

import pytest

from prophet_tf.bench import saved_profiles

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_a_reference_resolves_to_the_scaled_profile_it_names():
    ref = saved_profiles.reference("resnet50", 0.25)
    with open(saved_profiles.profile_path("resnet50"), "rb") as f:
        assert ref == {"name": "resnet50", "sha256": hashlib.sha256(f.read()).hexdigest(),
                       "scale": 0.25}
    shipped = saved_profiles.load_profile("resnet50")
    resolved = saved_profiles.resolve(ref)
    assert resolved == saved_profiles.scaled_profile(shipped, 0.25)
    assert resolved["compute_s"] == shipped["compute_s"] * 0.25
    # Without a scale: the shipped profile as it is.
    assert saved_profiles.resolve(saved_profiles.reference("cnn")) == \
        saved_profiles.load_profile("cnn")


def test_a_measured_profile_is_its_own_record():
    measured = {"model": "cnn", "compute_s": 0.05, "variables": []}
    assert not saved_profiles.is_reference(measured)
    assert saved_profiles.resolve(measured) is measured


def test_a_reference_to_a_changed_profile_is_refused_naming_both_hashes():
    ref = {**saved_profiles.reference("cnn", 2.0), "sha256": "0" * 64}
    with pytest.raises(ValueError) as e:
        saved_profiles.resolve(ref)
    assert "0" * 64 in str(e.value) and saved_profiles.reference("cnn")["sha256"] in str(e.value)
    assert "cnn.json" in str(e.value)
    with pytest.raises(FileNotFoundError, match="simulate --profile nosuchmodel"):
        saved_profiles.reference("nosuchmodel")


def _configs(run: dict):
    for cell in run.get("cells", []):
        yield cell["config"]
    for key in ("config", "bench_config"):
        if key in run:
            yield run[key]


def test_every_committed_run_names_a_shipped_profile_it_can_resolve():
    """The committed runs on shipped profiles store references (no copies), and
    every reference resolves: `simulate --validate` can re-simulate each of them."""
    references = 0
    for path in sorted(glob.glob(str(ROOT / "benchmarks" / "*.json"))):
        with open(path) as f:
            run = json.load(f)
        for config in _configs(run):
            profile = config.get("profile")
            if profile is None:
                continue
            if saved_profiles.is_reference(profile):
                resolved = saved_profiles.resolve(profile)
                assert resolved["model"] == config["model"], path
                references += 1
            else:  # measured in the run: real compute, never a scaled copy
                assert config["compute"] == "real" and "emulated_scale" not in profile, path
    assert references >= 40
