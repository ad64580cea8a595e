"""The README's first program runs as pasted."""

import os
import pathlib
import re
import subprocess
import sys

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_quickstart_runs_as_pasted(tmp_path):
  code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
  script = tmp_path / "quickstart.py"
  script.write_text(code)
  # A fresh interpreter, outside the source tree, as a reader would run it.
  env = {k: v for k, v in os.environ.items()
         if k not in ("XLA_FLAGS", "PYTHONPATH")}
  run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stdout + run.stderr
  assert "max abs error" in run.stdout and "schedule=None ran" in run.stdout
