"""Set-up in two commands: the README's first commands are what CI runs, and the requirements hold them up."""
import re

from conftest import ROOT


def readme_setup_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Set-up and a first run"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def test_ci_runs_exactly_the_readmes_two_set_up_commands():
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert ci == readme_setup_commands()
    assert readme_setup_commands() == ["pip install -r requirements.txt",
                                       "pip install -r requirements-test.txt && python -m pytest -q tests"]


def test_requirements_pin_torch_and_the_test_file_includes_them():
    runtime = (ROOT / "requirements.txt").read_text().splitlines()
    assert "torch==2.13.0" in runtime and any(line.startswith("tqdm") for line in runtime)
    assert "-r requirements.txt" in (ROOT / "requirements-test.txt").read_text().splitlines()
