"""Set-up in two commands, and the shape of the suite: the papers at the top, a tiny common.py, each run readable in
at most 800 lines, the algorithm repeated and the bookkeeping written once, a short README."""
import ast
import os
import re

import pytest

from conftest import ROOT


def readme_setup_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Set-up and a first run"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def test_ci_runs_exactly_the_readmes_two_set_up_commands():
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith(("#", "set ", "cd "))]
    # beside the install, a real Slurm for tests/test_slurm.py where CI runs as root (started, then waited for)
    slurm = [line for line in ci if "slurm" in line or line in ("fi", 'if [ "$(id -u)" = 0 ] && command -v apt-get '
                                                                      '>/dev/null; then')]
    assert len(slurm) == 5 and "bash tools/local_slurm.sh start" in slurm[2] and "wait" in slurm[4], slurm
    ci = [line for line in ci if line not in slurm]
    # in a new virtual environment, as a fresh machine installs (the newest versions the requirements admit)
    assert ci[:2] == ['python -m venv --clear "${TMPDIR:-/tmp}/suite-ci-venv"',
                      'source "${TMPDIR:-/tmp}/suite-ci-venv/bin/activate"']
    assert ci[2:] == readme_setup_commands()
    assert readme_setup_commands() == ["pip install -r requirements.txt",
                                       "pip install -r requirements-test.txt && python -m pytest -q -n auto tests"]


def test_requirements_pin_torch_and_the_test_file_includes_them():
    runtime = (ROOT / "requirements.txt").read_text().splitlines()
    assert "torch==2.13.0" in runtime and any(line.startswith("tqdm") for line in runtime)
    assert "-r requirements.txt" in (ROOT / "requirements-test.txt").read_text().splitlines()


METHOD_FILES = ["simcse.py", "simcsepp.py", "sscl.py", "whitenedcse.py", "micse.py"]
READER_FACING = {"common", "data", "eval_sts", "eval_transfer"}


def test_the_top_level_shows_the_papers():
    assert sorted(p.name for p in ROOT.glob("*.py")) == sorted(
        METHOD_FILES + ["common.py", "data.py", "eval_sts.py", "eval_transfer.py", "st_losses.py"])
    assert {p.name for p in (ROOT / "tools").glob("*.py")} == {"report.py", "protocols.py", "analyze.py", "bench.py",
                                                                    "parity.py", "tables.py", "memory.py",
                                                                    "mteb_eval.py", "mutants.py", "cluster.py",
                                                                    "slurm.py"}
    assert "what a first reading skips" in (ROOT / "plumbing" / "__init__.py").read_text().lower()


def test_only_st_losses_imports_sentence_transformers():
    """sentence-transformers stays optional: the method files, common.py, data.py, the evaluators and plumbing/ run
    without it; st_losses.py (its losses and trainer) is the one top-level file that imports it."""
    found = {p.name for p in [*ROOT.glob("*.py"), *ROOT.glob("plumbing/*.py")] if "sentence_transformers" in imports(p)}
    assert found == {"st_losses.py"}


def imports(path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def reading_path(name: str) -> dict[str, int]:
    """The method file and the reader-facing modules it imports, directly or through them: {file: lines}."""
    found, todo = {}, [name]
    while todo:
        current = todo.pop()
        if current not in found:
            found[current] = len((ROOT / current).read_text().splitlines())
            todo += [f"{module}.py" for module in imports(ROOT / current) & READER_FACING]
    return found


START, END = "# --- the objective: copy this block; it needs only torch ---", "# --- end of the objective ---"


def block_lines(name: str) -> int:
    """The method file's objective block: what a reader copies (the paper's equations and how to feed them)."""
    lines = (ROOT / name).read_text().splitlines()
    return lines.index(END) - lines.index(START) + 1


def paper_branch_nodes(node):
    """ast.walk, where train_step's branches on an option take the paper's side: GradCache (`if not
    args.micro_batch_size`) its body alone, --do_mlm's term (`if mlm ...`) neither side but its else."""
    todo = [node]
    while todo:
        n = todo.pop()
        yield n
        if isinstance(n, ast.If) and "micro_batch_size" in ast.unparse(n.test):
            todo += [n.test, *n.body]
        elif isinstance(n, ast.If) and "mlm" in ast.unparse(n.test):
            todo += list(n.orelse)
        else:
            todo += list(ast.iter_child_nodes(n))


def step_path(name: str) -> dict[str, int]:
    """The lines a reader follows for one training step, {file: lines}: train_step and every function or class of
    the method file, common.py and data.py it names, through what they name in turn (the paper's path: no GradCache,
    no MLM term). The plumbing a step calls is left out: each call says in its comment what it does, and on CPU the
    loop calls train_step itself (a CUDA graph replays it on a GPU)."""
    definitions = {}
    for file in (name, "common.py", "data.py"):
        for node in ast.parse((ROOT / file).read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                definitions[(file, node.name)] = node
    seen, todo = set(), [(name, "train_step")]
    while todo:
        key = todo.pop()
        if key in seen or key not in definitions:
            continue
        seen.add(key)
        for n in paper_branch_nodes(definitions[key]):
            if isinstance(n, ast.Name):
                todo.append((key[0], n.id))
            elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in ("common", "data"):
                todo.append((f"{n.value.id}.py", n.attr))
    path = {}
    for file, function in seen:
        node = definitions[(file, function)]
        path[file] = path.get(file, 0) + node.end_lineno - (node.decorator_list or [node])[0].lineno + 1
    return path


def test_common_is_tiny_and_a_step_and_a_run_read_in_the_lines_docs_methods_md_states():
    """docs/methods.md's reading table: one step's lines (step_path) and their files, the objective block's lines, and
    a run's other lines (the method file, common.py and data.py, the block aside), each run within 800. The counts
    are measured here and written there by hand: a moved count fails until the table is edited."""
    readme = (ROOT / "docs" / "methods.md").read_text()
    common_lines = len((ROOT / "common.py").read_text().splitlines())
    assert common_lines <= 250
    for name in METHOD_FILES:
        path = reading_path(name)
        assert set(path) == {name, "common.py", "data.py"}, (name, path)  # eval_sts.py is a run's plumbing's
        run = sum(path.values()) - block_lines(name)
        assert run <= 800, (name, path)
        step = step_path(name)
        files = ", ".join(f"`{file}`" for file in sorted(step, key=[name, "common.py", "data.py"].index))
        row = f"| `{name}` | {sum(step.values())} in {files} | {block_lines(name)} | {run} |"
        assert row in readme, row
    assert f"`common.py` ({common_lines} lines" in readme and \
        f"`data.py` ({len((ROOT / 'data.py').read_text().splitlines())} lines" in readme


def test_docs_methods_md_names_every_plumbing_call_the_reading_path_leaves_out():
    """A method file's reading path is itself, common.py and data.py; docs/methods.md names each plumbing call it
    makes."""
    readme = (ROOT / "docs" / "methods.md").read_text()
    paragraph = readme[readme.index("It leaves out the plumbing"):].split("\n\n")[0]
    owners = {"plumbing", "distributed", "hub", "options", "progress", "backbones", "run", "graph"}
    for name in METHOD_FILES:
        for node in ast.walk(ast.parse((ROOT / name).read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in owners:
                assert f"`{node.attr}`" in paragraph or f".{node.attr}`" in paragraph, (name, node.attr)


def main_lines(name: str) -> list[str]:
    source = (ROOT / name).read_text()
    tree = ast.parse(source)
    main = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main")
    return source.splitlines()[main.lineno - 1:main.end_lineno]


def function_lines(name: str, function: str) -> list[str]:
    source = (ROOT / name).read_text()
    node = next(node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef) and node.name == function)
    return source.splitlines()[node.lineno - 1:node.end_lineno]


def test_each_main_is_at_most_120_lines_and_shows_the_loop_and_the_gate():
    """main(): the data, the model, the optimiser, the loop with its scheduler step and the dev gate; the training
    step is one flat module-level function, train_step, in the paper's order, that main() hands on; no function is
    made inside main() (no closure made anew each step)."""
    for name in METHOD_FILES:
        main = "\n".join(main_lines(name))
        assert len(main_lines(name)) <= 120, name
        for visible in ("data.make_loader(", "common.make_optimizer(", "functools.partial(train_step,",
                        "scheduler.step()", "if step % args.eval_steps == 0 or step == total_steps:",
                        "run.dev_gate(step)", "run.save_best(step, backbone,", "run.evaluate_best(eval_pooler",
                        "run.write("):
            assert visible in main, (name, visible)
        step = "\n".join(function_lines(name, "train_step"))
        order = ["optimizer.zero_grad(set_to_none=True)", ".backward()", "scaler.unscale_(optimizer)",
                 "clip_grad_norm_(", "scaler.step(optimizer)", "scaler.update()", "return loss, grad_norm"]
        assert [step.index(v) for v in order] == sorted(step.index(v) for v in order), name
        assert "encoder(**" in (ROOT / name).read_text(), name  # the block's pass, which train_step calls
        tree = next(n for n in ast.parse((ROOT / name).read_text()).body if getattr(n, "name", None) == "main")
        assert not [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.Lambda)) and n is not tree], name


def test_each_method_docstring_is_short_and_names_paper_numbers_and_commands():
    """The docstring is a card (paper, idea, headline numbers, commands); the long notes live in docs/methods.md."""
    for name in METHOD_FILES:
        docstring = ast.get_docstring(ast.parse((ROOT / name).read_text()))
        assert len(docstring.splitlines()) <= 25, name
        assert re.search(r"\b20\d\d\b", docstring), (name, "the paper and its year")
        assert f"python {name}" in docstring, (name, "a command to run it")
        assert re.search(r"\d\d\.\d", docstring), (name, "a headline number")


def code_lines(name: str) -> list[str]:
    """The file's lines without blank and comment-only lines, white space folded (as a reader compares them)."""
    return [" ".join(line.split()) for line in (ROOT / name).read_text().splitlines()
            if line.strip() and not line.strip().startswith("#")]


def longest_shared_run(a: list[str], b: list[str]) -> int:
    best, previous = 0, [0] * (len(b) + 1)
    for x in a:
        current = [0] * (len(b) + 1)
        for j, y in enumerate(b, start=1):
            if x == y:
                current[j] = previous[j - 1] + 1
                best = max(best, current[j])
        previous = current
    return best


def test_no_identical_block_of_15_lines_is_shared_by_two_method_files():
    lines = {name: code_lines(name) for name in METHOD_FILES}
    for i, a in enumerate(METHOD_FILES):
        for b in METHOD_FILES[i + 1:]:
            assert longest_shared_run(lines[a], lines[b]) < 15, (a, b)


def test_the_core_fits_in_100_columns_and_everything_in_120():
    for path in [*ROOT.glob("*.py"), *(ROOT / "ablations").glob("*.py")]:
        long = [n for n, line in enumerate(path.read_text().splitlines(), 1) if len(line) > 100]
        if path.name not in ("eval_sts.py", "eval_transfer.py"):
            assert not long, f"{path.name}: lines over 100 characters: {long}"
    code = [*ROOT.glob("*.py"), *ROOT.glob("plumbing/*.py"), *ROOT.glob("tools/*.py"), *ROOT.glob("ablations/*.py")]
    for path in [*code, ROOT / "README.md", *ROOT.glob("docs/*.md")]:
        long = [n for n, line in enumerate(path.read_text().splitlines(), 1) if len(line) > 120]
        assert not long, f"{path.relative_to(ROOT)}: lines over 120 characters: {long}"


def test_reader_facing_files_import_no_tool_and_plumbing_no_paper():
    tools = {"report", "protocols", "analyze", "bench", "parity", "tables", "mteb_eval"}
    for path in [*ROOT.glob("*.py"), *(ROOT / "ablations").glob("*.py")]:
        assert not imports(path) & tools, path.name
    for path in (ROOT / "plumbing").glob("*.py"):
        assert not imports(path) & {"simcse", "simcsepp", "sscl", "whitenedcse", "micse", *tools}, path.name
    plumbing_core = imports(ROOT / "plumbing" / "__init__.py")
    assert not plumbing_core & {"common", "data", "eval_sts", "eval_transfer", "plumbing"}
    for path in ROOT.rglob("*.py"):
        assert "noqa" + ": F401" not in path.read_text(), path  # nothing is re-exported


def test_eval_sts_is_the_protocol():
    tree = ast.parse((ROOT / "eval_sts.py").read_text())
    assert not imports(ROOT / "eval_sts.py") & {"socket", "tarfile", "json", "huggingface_hub", "safetensors", "urllib"}
    defined = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    assert not defined & {"Parser", "UsageError", "cli", "write_json", "hub_file", "load_pretrained", "pool",
                          "write_sentence_transformers_config"}
    assert {"spearman", "encode_unique", "alignment_uniformity"} <= defined  # the metric the dev gate uses too


# The floors of the house, from the ground up: a module imports its own floor's and the ones below, never above.
FLOORS = [{"common"},
          {"plumbing", "plumbing.progress", "plumbing.files", "plumbing.distributed", "plumbing.syncs",
           "plumbing.backbones", "plumbing.hub", "plumbing.provenance", "plumbing.resume", "plumbing.lock",
           "plumbing.outdir", "plumbing.checkpoint"},
          {"data", "eval_sts", "eval_transfer"},
          {"plumbing.options", "plumbing.run", "plumbing.memory"}]  # then the method files, the ablations and the tools


def suite_imports(path) -> set[str]:
    """The suite's modules `path` imports, as dotted names (`from plumbing import hub` is plumbing.hub)."""
    suite = set().union(*FLOORS)
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found & suite


def test_no_import_runs_from_a_lower_floor_to_a_higher_one():
    floor = {module: i for i, modules in enumerate(FLOORS) for module in modules}
    for module, level in floor.items():
        path = ROOT / (module.replace(".", "/") + ".py" if module != "plumbing" else "plumbing/__init__.py")
        above = {m for m in suite_imports(path) if floor[m] > level}
        assert not above, (module, above)


def test_common_is_the_ground_floor_and_imports_nothing_of_the_suite():
    """A copied common.py works on its own; the layers above import it, never the other way round."""
    suite = {path.stem for path in ROOT.glob("*.py")} | {"plumbing", "tools", "ablations"}
    assert not imports(ROOT / "common.py") & suite


def test_the_readme_is_a_guide_of_250_lines_with_docs_beside_it():
    readme = (ROOT / "README.md").read_text().splitlines()
    assert len(readme) <= 250
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert {"methods.md", "arguments.md", "evaluation.md", "reproducing.md", "engineering.md", "tests.md"} <= pages
    for page in pages:
        assert f"docs/{page}" in "\n".join(readme), page  # linked from the guide


def test_the_readmes_test_time_is_the_one_docs_tests_md_measured():
    """The README quotes the suite's time from docs/tests.md's measurement, not a figure of its own."""
    import re
    readme = (ROOT / "README.md").read_text()
    measured = re.search(r"The default suite \(.*?\) took (\d+ min \d+ s) on 2 idle", (ROOT / "docs" / "tests.md")
                         .read_text(), re.S).group(1)
    assert f"runs the tests: {measured} on 2 idle cores" in readme, measured


def test_pytest_workers_follow_a_containers_cpu_quota(monkeypatch):
    """`-n auto` runs a worker a core this process may use: a cgroup's CPU quota (v2's cpu.max, v1's cfs files) caps
    the affinity's count, "max" and -1 do not, nor does a quota above it. Reading the period as the quota, ignoring
    v1, or a quota that raises the count fails it."""
    import builtins
    import io
    import conftest
    v2, v1, v1_period = ("/sys/fs/cgroup/cpu.max", "/sys/fs/cgroup/cpu/cpu.cfs_quota_us",
                         "/sys/fs/cgroup/cpu/cpu.cfs_period_us")
    real_open, files = builtins.open, {}

    def fake_open(path, *args, **kwargs):
        if path in (v2, v1, v1_period):
            if path not in files:
                raise FileNotFoundError(path)
            return io.StringIO(files[path])
        return real_open(path, *args, **kwargs)
    monkeypatch.setattr(conftest.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setattr(builtins, "open", fake_open)
    for given, cores in (({}, 16), ({v2: "200000 100000\n"}, 2), ({v2: "max 100000\n"}, 16),
                         ({v2: "50000 100000\n"}, 1), ({v1: "300000\n", v1_period: "100000\n"}, 3),
                         ({v1: "-1\n", v1_period: "100000\n"}, 16), ({v2: "3200000 100000\n"}, 16)):
        files.clear()
        files.update(given)
        assert conftest.available_cores() == cores, given


@pytest.mark.skipif(not os.environ.get("PYTEST_XDIST_WORKER"), reason="a pytest -n worker's setting (the README's "
                    "command runs it)")
def test_each_pytest_worker_gives_torch_its_share_of_the_cores():
    """Under `-n auto` each worker's torch and the processes it starts use the worker's share of the cores (two
    workers of two threads on two cores ran the suite no faster than one process). A worker left at torch's default,
    or a child process that does not inherit the setting, fails it."""
    import subprocess
    import sys
    import torch
    import conftest
    share = max(1, conftest.available_cores() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    want = int(os.environ.get("OMP_NUM_THREADS", share))
    child = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], capture_output=True,
                           text=True, check=True).stdout
    assert torch.get_num_threads() == want and int(child) == want, (torch.get_num_threads(), child, want)


def test_the_readmes_simcse_loop_is_simcse_py_s():
    """The README's loop (its Python block with run.steps()) is simcse.py's main(): each of its lines stands there, in
    order, so
    that a changed step (what `train` returns, what `run.record` takes) fails here, not in a reader's copy. The
    block read with `loss, grad_norm = train(...)` while the step returned three values."""
    readme = (ROOT / "README.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "run.steps()" in b)
    code = [line.strip() for line in (ROOT / "simcse.py").read_text().splitlines()]
    at = 0
    for line in filter(None, (line.strip() for line in block.splitlines())):
        found = next((i for i in range(at, len(code)) if code[i] == line), None)
        assert found is not None, f"README's line not in simcse.py (in order): {line}"
        at = found + 1


def markdown_tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """Each table of a Markdown text: its header's cells and its rows' cells."""
    tables, lines = [], text.splitlines()
    for i, line in enumerate(lines[:-1]):
        if line.startswith("|") and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[i + 1]):
            rows, j = [], i + 2
            while j < len(lines) and lines[j].startswith("|"):
                rows.append([cell.strip() for cell in lines[j].strip("|").split("|")])
                j += 1
            tables.append(([cell.strip() for cell in line.strip("|").split("|")], rows))
    return tables


NUMBERS = r"\d+\.\d\d"
# What a cell under each header of the README's tables holds: a header that is not here fails, so a new table says
# what its columns mean; a cell of another kind (a line count under "paper", as 4bdf32a wrote) fails.
README_CELLS = {
    "file": r"`[a-z_]+\.py`",
    "paper": r"[A-Za-z+]+ \([A-Z][a-z]+ (et al\.|& [A-Z][a-z]+) 20\d\d\)",
    "idea": r"[a-z][^|0-9]*[a-zA-Z]",
    "BERT-base STS avg (paper)": rf"{NUMBERS}(; [a-z 0-9%]+ {NUMBERS})?",
    "path": r"`[^`]+`(, `[^`]+`)*( … `[^`]+`)?",
    "what it holds": r"[a-z`\[][^|]*[a-zA-Z)]",
    "page": r"\[docs/[a-z]+\.md\]\(docs/[a-z]+\.md\)",
    "topic": r"[a-z`][^|]*",
}


def test_every_readme_table_holds_in_each_column_what_its_header_names():
    """Each README table's cells are of the kind its header names: the papers' table holds papers, ideas and the
    papers' numbers, not the reading table's line counts (`| simcse.py | 147 in simcse.py, common.py | 101 | 727 |`
    stood under "paper | idea | BERT-base STS avg (paper)" from 4bdf32a on, and a test that looked only for the
    rows somewhere in the README passed)."""
    tables = markdown_tables((ROOT / "README.md").read_text())
    assert len(tables) >= 3
    for header, rows in tables:
        for column in header:
            assert column in README_CELLS, f"a README table's header {column!r} has no kind in README_CELLS"
        for row in rows:
            assert len(row) == len(header), (header, row)
            for column, cell in zip(header, row):
                assert re.fullmatch(README_CELLS[column], cell), f"{column!r}: {cell!r}"
        if "path" in header:  # the layout's paths exist
            for row in rows:
                for path in re.findall(r"`([^`]+)`", row[0]):
                    assert (ROOT / path.rstrip("/")).exists(), path


def headline_numbers(name: str) -> list[str]:
    """The method's own numbers in its docstring's headline: those outside parentheses (the baselines' within)."""
    docstring = ast.get_docstring(ast.parse((ROOT / name).read_text()))
    headline = " ".join(docstring[docstring.index("Headline ("):].split("\n\n")[0].split())
    claims = headline[headline.index("): ") + 3:]
    return re.findall(NUMBERS, re.sub(r"\([^)]*\)", "", claims))


def test_the_readmes_papers_table_gives_each_method_files_headline():
    """The papers' table's STS averages are the method files' docstring headlines (what `--help` prints), each the
    method's own figures in the same order: an edited headline or a stale README row fails here."""
    header, rows = markdown_tables((ROOT / "README.md").read_text())[0]
    assert header == ["file", "paper", "idea", "BERT-base STS avg (paper)"]
    assert [row[0].strip("`") for row in rows] == METHOD_FILES
    for row in rows:
        own = headline_numbers(row[0].strip("`"))
        assert own and re.findall(NUMBERS, row[3]) == own, (row[0], row[3], own)


def test_the_cpu_torch_advice_stands_before_the_set_up_lines_ci_runs():
    """The README tells a CPU-only machine to install torch's CPU build before the two set-up lines (it came after
    them, so a reader who ran the block first pulled the CUDA build); it stays outside the block, which .ci/run runs
    as it is (CI reaches PyPI only, not PyTorch's index), with the version requirements.txt pins."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Set-up and a first run"):]
    block_at = section.index("```bash")
    pin = next(line for line in (ROOT / "requirements.txt").read_text().splitlines() if line.startswith("torch=="))
    advice = f"`pip install {pin} --index-url\nhttps://download.pytorch.org/whl/cpu`"
    assert advice in section[:block_at], "the CPU build's install line before the set-up block"
    assert "whl/cpu" not in "\n".join(readme_setup_commands())


def test_the_readmes_offline_runs_are_commands_their_scripts_accept(monkeypatch):
    """The README's offline commands (the miCSE quick-start, the SimCSE demo) are parsed by their own scripts' flags
    from the repository root, where ../shared lies: a renamed flag or a path that moved fails here, not on a newcomer's
    first try (the user's `micse.py --fraction 0.01 --seed 3` took two tries: no offline miCSE command stood there)."""
    import shlex
    from conftest import needs_shared
    if needs_shared.args[0]:
        pytest.skip(needs_shared.kwargs["reason"])
    import micse
    import simcse
    text = (ROOT / "README.md").read_text()
    commands = [" ".join(block.replace("\\\n", " ").split()) for block in re.findall(r"```bash\n(.*?)```", text, re.S)]
    commands = [c for block in commands for c in re.split(r" (?=python )", block) if "../shared" in c]
    scripts = {"micse.py": micse.parse_args, "simcse.py": simcse.parse_args}
    found = [c for c in commands if c.split()[1] in scripts]
    assert {c.split()[1] for c in found} == set(scripts), commands
    assert any("--fraction 0.01 --seed 3" in c for c in found)
    monkeypatch.chdir(ROOT)
    for command in found:
        args = scripts[command.split()[1]](shlex.split(command)[2:])
        assert args.model_name_or_path.endswith("all-MiniLM-L6-v2") and args.max_steps, command
