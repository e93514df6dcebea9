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


METHOD_FILES = ["simcse.py", "simcsepp.py", "sscl.py", "whitenedcse.py", "micse.py"]


def test_the_core_a_student_reads_fits_in_100_columns_and_reexports_nothing():
    ablations = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "ablations").glob("*.py"))]
    assert len(ablations) == 3
    for name in ["common.py", *METHOD_FILES, *ablations]:
        long = [n for n, line in enumerate((ROOT / name).read_text().splitlines(), 1) if len(line) > 100]
        assert not long, f"{name}: lines over 100 characters: {long}"
    for path in ROOT.glob("*.py"):
        assert "noqa: F401" not in path.read_text(), path.name


def test_eval_sts_is_the_protocol_and_plumbing_is_a_leaf():
    import ast
    source = (ROOT / "eval_sts.py").read_text()
    tree = ast.parse(source)
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                for alias in node.names} | {node.module.split(".")[0] for node in ast.walk(tree)
                                             if isinstance(node, ast.ImportFrom) and node.module}
    assert not imported & {"socket", "tarfile", "json", "huggingface_hub", "safetensors", "urllib"}
    defined = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    assert not defined & {"Parser", "UsageError", "cli", "write_json", "hub_file", "load_pretrained",
                          "write_sentence_transformers_config"}
    plumbing_imports = {alias.name for node in ast.walk(ast.parse((ROOT / "plumbing.py").read_text()))
                        if isinstance(node, ast.Import) for alias in node.names}
    assert not plumbing_imports & {"common", "eval_sts", "eval_transfer", "distributed", "report"}


def test_each_method_shows_its_test_evaluation_and_the_write_of_results():
    for name in METHOD_FILES:
        main = (ROOT / name).read_text().split("def main(", 1)[1]
        for line in ('encode = eval_sts.load_encode(str(out / "best"), eval_pooler, device)',
                     'results["test"] = common.sts_test_scores(encode, senteval_dir)',
                     'plumbing.write_json(out / "results.json", results)'):
            assert line in main, (name, line)
