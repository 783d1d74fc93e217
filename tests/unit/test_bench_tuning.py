"""The peer at its best: tf-mwms's pack size, measured and chosen, reaches its workers."""
import types

import pytest

from prophet_tf.bench import bench_cli, training_run, tuning, worker


def test_the_fastest_pack_size_wins_and_near_ties_go_to_tensorflows_default():
    rows = [{"bytes_per_pack": p, "step_time_s": s}
            for p, s in zip(tuning.TF_MWMS_PACK_BYTES, (0.260, 0.250, 0.240, 0.245))]
    assert tuning.choose_pack(rows) == 4 << 20
    rows[0]["step_time_s"] = 0.2440  # within 2% of the fastest: TensorFlow's default
    assert tuning.choose_pack(rows) == 0
    with pytest.raises(ValueError, match=r"rows=\[\]"):
        tuning.choose_pack([])


def test_the_pack_size_goes_to_tf_mwms_workers_only():
    args = types.SimpleNamespace(model="cnn", steps=30, global_batch=64, compute="real")
    argv = training_run.worker_argv("tf-mwms", args, "out.json", {"bytes_per_pack": 4 << 20})
    assert argv[argv.index("--bytes-per-pack") + 1] == str(4 << 20)
    assert "--bytes-per-pack" not in training_run.worker_argv("tf-mwms", args, "out.json")
    assert "--bytes-per-pack" not in training_run.worker_argv(
        "prophet", args, "out.json", {"partition_bytes": 1000})
    parsed = worker._parse(["--framework", "tf-mwms", "--steps", "3", "--out", "o",
                            "--bytes-per-pack", "1048576"])
    assert parsed.bytes_per_pack == 1 << 20


@pytest.mark.parametrize("argv, message", [
    (["--framework", "prophet", "--bytes-per-pack", "1024"], "--framework prophet"),
    (["--framework", "tf-mwms", "--bytes-per-pack", "-1"], "--bytes-per-pack=-1"),
])
def test_a_bad_pack_size_is_refused_naming_it(argv, message, capsys):
    with pytest.raises(SystemExit):
        worker._parse(argv + ["--steps", "3", "--out", "o"])
    assert message in capsys.readouterr().err


def test_the_bench_refuses_a_negative_pack_size(capsys):
    with pytest.raises(SystemExit):
        bench_cli._parse(["--tf-mwms-bytes-per-pack", "-5"])
    assert "--tf-mwms-bytes-per-pack=-5" in capsys.readouterr().err
    assert bench_cli._parse([]).tf_mwms_bytes_per_pack is None


def test_global_clipnorm_reaches_every_framework_s_workers(capsys):
    args = types.SimpleNamespace(model="cnn", steps=30, global_batch=64, compute="real",
                                 global_clipnorm=1.5)
    for framework in ("prophet", "tf-mwms"):
        argv = training_run.worker_argv(framework, args, "out.json")
        parsed = worker._parse(argv[argv.index("--framework"):])
        assert parsed.global_clipnorm == 1.5
    args.global_clipnorm = None
    assert "--global-clipnorm" not in training_run.worker_argv("prophet", args, "out.json")
    with pytest.raises(SystemExit):
        bench_cli._parse(["--global-clipnorm", "0"])
    assert "--global-clipnorm=0.0" in capsys.readouterr().err
