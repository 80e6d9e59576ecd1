"""data.source=python_packages: one document per installed package, files deduplicated by content,
and the validation split by package name."""

import os

from moezoo.configs import DataConfig
from moezoo.training import corpus_packages
from moezoo.training.corpus import load_documents, split_documents


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def test_packages_are_documents_with_each_file_once(tmp_path):
    a, b = str(tmp_path / "a" / "site-packages"), str(tmp_path / "b" / "site-packages")
    write(f"{a}/alpha/__init__.py", "x = 1\n")
    write(f"{a}/alpha/sub/util.py", "def f():\n    return 2\n")
    # same content as alpha's: counted once
    write(f"{a}/beta/vendored.py", "def f():\n    return 2\n")
    write(f"{a}/beta/own.py", "y = 3\n")
    write(f"{a}/solo.py", "z = 4\n")  # a top-level module is a package too
    write(f"{a}/alpha-1.0.dist-info/RECORD.py", "nope = 1\n")  # metadata folders are skipped
    write(f"{b}/alpha/__init__.py", "shadowed = 1\n")  # later directory: not read
    docs = dict(corpus_packages.package_texts([a, b]))
    assert sorted(docs) == ["alpha", "beta", "solo"]
    assert (
        "return 2" in docs["alpha"] and "return 2" not in docs["beta"] and "y = 3" in docs["beta"]
    )
    assert "shadowed" not in docs["alpha"] and "# file: alpha/sub/util.py" in docs["alpha"]


def test_no_package_is_in_both_splits(tmp_path, monkeypatch):
    root = str(tmp_path / "site-packages")
    for i in range(40):
        write(f"{root}/pkg{i}/__init__.py", f"value = {i}\n")
        write(f"{root}/pkg{i}/mod.py", f"def g{i}():\n    return {i}\n")
    monkeypatch.setattr(corpus_packages, "site_dirs", lambda: [root])
    docs = load_documents(DataConfig(source="python_packages"))
    assert len(docs) == 40 and len({d.name for d in docs}) == 40
    train, val = split_documents(docs, 0.2)
    assert val and train and not {d.name for d in train} & {d.name for d in val}
    assert len(load_documents(DataConfig(source="python_packages", max_files=5))) == 5


def test_the_installed_packages_are_found():
    # torch (the one package the tests need) is among the packages of the interpreter's site
    # directories
    assert any("torch" in corpus_packages._package_files(d) for d in corpus_packages.site_dirs())


def test_preflight_accepts_every_builtin_source(tmp_path):
    # train.py's path check runs before any work: a built-in corpus name is not a path to look for
    from moezoo.configs import ConfigError, load_config
    from moezoo.training.corpus import BUILTIN_SOURCES
    from moezoo.training.preflight import check_paths

    base = ["train.device=cpu", f"train.out_dir={tmp_path}/out", f"data.cache_dir={tmp_path}/cache"]
    for src in BUILTIN_SOURCES:
        check_paths(load_config("zoo/tiny_dense.yaml", base + [f"data.source={src}"]))
    try:
        check_paths(
            load_config("zoo/tiny_dense.yaml", base + [f"data.source={tmp_path}/missing*.txt"])
        )
    except ConfigError as e:
        assert str(e).startswith("data.source: ") and "python_packages" in str(e)
    else:
        raise AssertionError("a missing data.source passed the path check")
