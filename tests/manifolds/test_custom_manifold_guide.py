"""docs/custom-manifold.md's training example (Step 4) runs without a warning (issue 53, item 13): checking a
`geoopt.ManifoldParameter` (a tensor that needs grad) with `check_point_on_manifold` warned from
manifolds/base.py."""

import re
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_step_4_of_the_custom_manifold_guide_runs_without_a_warning(monkeypatch, capsys):
    text = (REPO / "docs" / "custom-manifold.md").read_text()
    step = text[text.index("## Step 4") :]
    (code,) = re.findall(r"```python\n(.*?)```", step[: step.index("\n## ", 1)], flags=re.S)[:1]
    monkeypatch.chdir(REPO)  # it puts docs/examples on sys.path, relative to the checkout
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", "`torch.jit.script.*` is deprecated", DeprecationWarning)
        exec(compile(code, "docs/custom-manifold.md (Step 4)", "exec"), {})
    assert "on manifold: True" in capsys.readouterr().out
