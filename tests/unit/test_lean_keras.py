"""prophet_tf.lean_keras: Keras trains without importing scikit-learn and matplotlib, which
the program can still import itself."""
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)


def _run(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split()


def test_keras_trains_without_its_integrations_and_imports_them_when_allowed():
    skipped, imported, raised, step = _run("""
        import sys
        from prophet_tf.lean_keras import skip_keras_integrations
        skipped = skip_keras_integrations()
        import numpy as np, keras
        imported = [m for m in ("sklearn", "matplotlib") if m in sys.modules]
        import sklearn.datasets, matplotlib  # the program's own imports still work
        raised = hasattr(sklearn.datasets, "load_digits")
        opt = keras.optimizers.Adam(0.1)
        v = keras.Variable(np.ones(3, "float32"))
        opt.apply([keras.ops.ones(3)], [v])
        print(skipped, imported or "none", raised, float(v.numpy()[0]))
    """)
    assert (skipped, imported, raised) == ("True", "none", "True")
    assert float(step) == pytest.approx(0.9, abs=1e-6)


def test_without_it_keras_imports_both_and_once_imported_it_changes_nothing():
    """Keras imports both (they are installed here): what it saves. Called after
    Keras is imported, it leaves every import as it is."""
    assert _run("""
        import sys, keras
        from prophet_tf.lean_keras import skip_keras_integrations
        print(all(m in sys.modules for m in ("sklearn", "matplotlib")),
              skip_keras_integrations(), type(sys.meta_path[0]).__name__ != "_Unimportable")
        import sklearn.datasets
    """) == ["True", "False", "True"]
