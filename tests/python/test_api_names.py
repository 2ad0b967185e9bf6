"""API_NAMES.md against the code: every Python name exists in the package,
every C++ name is declared in a public header, every CLI subcommand exists,
the Python name is the snake_case of the C++ one (rows marked *reference*
excepted), and each binding name in python/src/bind_*.cpp is the snake_case
of the C++ member or function it calls."""
import pathlib
import re

import pytest

import shardema

ROOT = pathlib.Path(__file__).resolve().parents[2]
HEADER_ROOTS = ["core/include", "shard/include", "offload/include", "lib/include"]


def snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).lower()


def camel(name: str) -> str:
    first, *rest = name.split("_")
    return first + "".join(part[:1].upper() + part[1:] for part in rest)


def rows():
    text = (ROOT / "API_NAMES.md").read_text(encoding="utf-8")
    out = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or cells[0] in ("Python", "---") or set(cells[0]) <= {"-"}:
            continue
        unquote = [c.strip("`") for c in cells[:3]]
        out.append((*unquote, "*reference*" in cells[3]))
    return out


ROWS = rows()
HEADERS = "\n".join(p.read_text() for root in HEADER_ROOTS
                    for p in (ROOT / root).rglob("*.h"))
CLI = (ROOT / "tools" / "command_line.cpp").read_text()


def test_the_table_has_its_rows():
    assert len(ROWS) >= 30


@pytest.mark.parametrize("python, cpp, cli, reference", ROWS, ids=[r[0] or r[1] for r in ROWS])
def test_each_row_names_what_exists_the_same_way(python, cpp, cli, reference):
    if python:
        obj = shardema
        for part in python.split("."):
            assert hasattr(obj, part), f"shardema.{python} does not exist"
            obj = getattr(obj, part)
    name = cpp.split("::")[-1]
    owner = cpp.split("::")[-2] if "::" in cpp else None
    if owner and owner != "shard":
        assert re.search(rf"\b(class|struct) {owner}\b", HEADERS), f"{owner} is not declared"
    assert re.search(rf"\b{name}\b\s*[({{;]|\b(class|struct) {name}\b", HEADERS), \
        f"{cpp} is not declared in a public header"
    if python and not reference:
        last = python.split(".")[-1]
        assert last == name if last[:1].isupper() else snake(name) == last, \
            f"{python} is not the snake_case of {cpp}"
    if cli:
        sub = cli.split()[1]
        assert f'"{sub}"' in CLI, f"the CLI has no subcommand {sub}"


def binding_defs():
    """(file, python name, the C++ text that implements it) of every .def."""
    out = []
    for path in sorted((ROOT / "python" / "src").glob("bind_*.cpp")):
        text = path.read_text()
        for match in re.finditer(r'(?:\.(?:def|def_static|def_property_readonly|def_readonly)|'
                                 r'\bm\.def)\(\s*"([a-z][a-z_0-9]*)"', text):
            body = text[match.end():match.end() + 2000]
            end = re.search(r"\n\s*(\.def|m\.def|py::class_)", body)
            out.append((path.name, match.group(1), body[:end.start()] if end else body))
    return out


DEFS = binding_defs()


def test_the_bindings_were_found():
    assert len(DEFS) >= 50


@pytest.mark.parametrize("file, name, body", DEFS, ids=[f"{f}:{n}" for f, n, _ in DEFS])
def test_each_binding_calls_the_cpp_of_its_name(file, name, body):
    assert re.search(rf"\b{camel(name)}\b", body), \
        f"{file}: _C's {name} does not call a C++ {camel(name)}"


def test_messages_speak_python_with_the_tables_names():
    """The C++ -> Python rewrite of messages (python/src/python_terms.h)
    gives each C++ name of this table the Python name of the same row, and
    any other Averager member its snake_case."""
    from shardema import _C
    by_cpp = {}
    for python, cpp, _, _ in ROWS:
        if python and "::" in cpp:
            by_cpp.setdefault(cpp, {"shardema.EMA"}).add(f"shardema.{python}")
    for cpp, python in _C._python_terms():
        if cpp in by_cpp:  # one of that C++ name's rows (or the class, where it serves several)
            assert python in by_cpp[cpp], (cpp, python, sorted(by_cpp[cpp]))
    assert _C._in_python_terms("Averager::update: x") == "shardema.EMA.update: x"
    assert _C._in_python_terms("Averager::loadEmaValues: y") == "shardema.EMA.load_ema_values: y"
    assert _C._in_python_terms("ShardedAverager::fullStateDict: z") == \
        "shardema.EMA.full_state_dict: z"
    assert _C._in_python_terms(
        "restore a saved state with loadState() or load() to continue") == \
        "restore it with load_state_dict() or load_checkpoint() to continue"
    assert _C._in_python_terms("shardema.EMA.update: unchanged") == "shardema.EMA.update: unchanged"
