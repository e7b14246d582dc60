"""tools/type_ignores.py: every ``type: ignore`` in src/ carries a reason (.ci/run runs it on src)."""

import importlib.util
import pathlib

TOOL = pathlib.Path(__file__).resolve().parents[2] / "tools" / "type_ignores.py"
spec = importlib.util.spec_from_file_location("type_ignores", TOOL)
type_ignores = importlib.util.module_from_spec(spec)
spec.loader.exec_module(type_ignores)


def test_an_ignore_without_a_reason_is_found_and_one_with_a_reason_is_not():
    src = ("a = f()  # type: ignore[attr-defined]\n"
           "b = g()  # type: ignore[arg-type]  # numpy stubs lack the buffer protocol\n"
           "c = h()  # type: ignore\n"
           "d = '# type: ignore'  # a string, not a comment\n"
           "e = k()  # noqa: E501  # type: ignore[misc]  # why\n")
    assert type_ignores.ignores(src) == [(1, False), (2, True), (3, False), (5, True)]


def test_scan_counts_a_tree_and_names_the_bare_ones(tmp_path):
    (tmp_path / "m.py").write_text("x = 1  # type: ignore[misc]\ny = 2  # type: ignore[misc]  # why\n")
    total, bare = type_ignores.scan([tmp_path])
    assert total == 2 and bare == [f"{tmp_path / 'm.py'}:1"]
