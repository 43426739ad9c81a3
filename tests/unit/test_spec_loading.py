"""Loading spec files: exact error messages, name recovery, directory scans, duplicates."""

from __future__ import annotations

from pathlib import Path

import pytest

from herd_operator.specs import (
    MAX_SPEC_BYTES,
    SpecError,
    SpecFile,
    index_specs,
    is_spec_filename,
    load_spec_file,
    load_spec_text,
    loading,
    scan_spec_dir,
)

HEADER = "apiVersion: herd/v1alpha1\nkind: HerdJob\n"
GOOD = (
    HEADER
    + "metadata: {name: resnet}\nspec: {command: [python, train.py], gpus: {min: 1, max: 2}}\n"
)

SPEC_FIELDS = (
    "command, workingDir, env, gpus, priority, policy, engine, horovod, restartPolicy, training,"
    " suspend,"
    " activeDeadlineSeconds, dependsOn"
)


def job_yaml(name: str, spec: str = "{command: [python], gpus: {min: 1, max: 2}}") -> str:
    return HEADER + f"metadata: {{name: {name}}}\nspec: {spec}\n"


def problems(text: str) -> list[tuple[str, str]]:
    loaded = load_spec_text(text, "jobs/x.yaml")
    assert loaded.job is None
    assert all(error.file == "jobs/x.yaml" for error in loaded.errors)
    return [(error.field, error.message) for error in loaded.errors]


def write(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.write_text(text, encoding="utf-8")
    return path


def test_good_file_loads(tmp_path: Path) -> None:
    path = write(tmp_path, "resnet.yaml", GOOD)
    loaded = load_spec_file(path)
    assert loaded.valid
    assert loaded.errors == ()
    assert loaded.name == "resnet"
    assert loaded.path == path
    assert loaded.job is not None
    assert loaded.job.spec.command == ["python", "train.py"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            job_yaml("a", "{command: [x]}"), [("spec.gpus", "required")], id="missing-gpus"
        ),
        pytest.param(
            job_yaml("a", "{command: [x], gpus: {min: 3, max: 2}}"),
            [("spec.gpus", "min (3) must not exceed max (2)")],
            id="min-above-max",
        ),
        pytest.param(
            job_yaml("a", "{command: [x], gpus: {min: 0, max: 2}}"),
            [("spec.gpus.min", "must be at least 1, got integer 0")],
            id="min-zero",
        ),
        pytest.param(
            job_yaml("My_Job"),
            [
                (
                    "metadata.name",
                    "must be a DNS-1123 label (lowercase letters, digits and '-', starting and "
                    "ending with a letter or digit, at most 63 characters)",
                )
            ],
            id="bad-name",
        ),
        pytest.param(
            # `status` is allowed (and ignored): what `get NAME -o yaml` saved to a file has it.
            job_yaml("a") + "stats: {}\n",
            [("stats", "unknown field (allowed: apiVersion, kind, metadata, spec)")],
            id="unknown-top-level",
        ),
        pytest.param(
            job_yaml("a", "{command: [x], gpu: {min: 1, max: 1}}"),
            [("spec.gpu", f"unknown field (allowed: {SPEC_FIELDS})"), ("spec.gpus", "required")],
            id="unknown-spec-field",
        ),
        pytest.param(
            job_yaml("a", "{command: [x], gpus: {min: 1, max: 1}, horovod: {timeout: 5}}"),
            [
                (
                    "spec.horovod.timeout",
                    "unknown field "
                    "(allowed: elasticTimeoutSeconds, glooTimeoutSeconds, growTimeoutSeconds, "
                    "resetLimit, extraArgs, launcher, preload)",
                )
            ],
            id="unknown-nested-field",
        ),
        pytest.param(
            GOOD.replace("herd/v1alpha1", "herd/v1"),
            [("apiVersion", "must be 'herd/v1alpha1', got string 'herd/v1'")],
            id="wrong-api-version",
        ),
        pytest.param(
            GOOD.replace("kind: HerdJob", "kind: Job"),
            [("kind", "must be 'HerdJob', got string 'Job'")],
            id="wrong-kind",
        ),
        pytest.param(
            job_yaml("a", "{command: [], gpus: {min: 1, max: 1}}"),
            [("spec.command", "must not be empty")],
            id="empty-command",
        ),
        pytest.param(
            job_yaml("a", "{command: python train.py, gpus: {min: 1, max: 1}}"),
            [("spec.command", "expected a list, got string 'python train.py'")],
            id="command-not-a-list",
        ),
        pytest.param(
            job_yaml("a", "{command: [python, '', 10], gpus: {min: 1, max: 1}}"),
            [
                ("spec.command[1]", "must not be empty"),
                ("spec.command[2]", "expected a string, got integer 10 (put it in quotes)"),
            ],
            id="bad-command-items",
        ),
        pytest.param(
            job_yaml("a", "{command: [x], gpus: {min: 1, max: 1}, env: {1BAD: x, OK: 4}}"),
            [
                (
                    "spec.env.1BAD",
                    "invalid environment variable name '1BAD': must match [A-Za-z_][A-Za-z0-9_]*",
                ),
                ("spec.env.OK", "expected a string, got integer 4 (put it in quotes)"),
            ],
            id="bad-env",
        ),
        pytest.param(
            job_yaml("a", "{command: [x], gpus: {min: '1', max: 1.5}}"),
            [
                ("spec.gpus.max", "expected an integer, got number 1.5"),
                ("spec.gpus.min", "expected an integer, got string '1'"),
            ],
            id="non-integer-gpus",
        ),
        pytest.param(
            job_yaml("a", "{command: [x], gpus: {min: 1, max: 1}, restartPolicy: {onFailure: 1}}"),
            [("spec.restartPolicy.onFailure", "expected a boolean (true or false), got integer 1")],
            id="non-boolean",
        ),
        pytest.param(
            job_yaml("a", "{command: [x], gpus: 2}"),
            [("spec.gpus", "expected a mapping, got integer 2")],
            id="gpus-not-a-mapping",
        ),
        pytest.param(
            job_yaml("a", "{command: [x], gpus: {min: 1, max: 1}, horovod: {resetLimit: -1}}"),
            [("spec.horovod.resetLimit", "must be at least 0, got integer -1")],
            id="negative-reset-limit",
        ),
        pytest.param(
            job_yaml(
                "a", "{command: [x], gpus: {min: 1, max: 1}, horovod: {elasticTimeoutSeconds: 0}}"
            ),
            [("spec.horovod.elasticTimeoutSeconds", "must be greater than 0, got integer 0")],
            id="zero-timeout",
        ),
        pytest.param(
            HEADER + "metadata: {name: a, labels: {app.kubernetes.io/name: 3}}\n"
            "spec: {command: [x], gpus: {min: 1, max: 1}}\n",
            [
                (
                    "metadata.labels['app.kubernetes.io/name']",
                    "expected a string, got integer 3 (put it in quotes)",
                )
            ],
            id="odd-key-is-quoted",
        ),
        pytest.param(
            "kind: HerdJob\n",
            [
                ("apiVersion", "required"),
                ("metadata", "required"),
                ("spec", "required"),
            ],
            id="sorted-by-field",
        ),
        pytest.param("", [("(file)", "file is empty")], id="empty"),
        pytest.param("# only a comment\n", [("(file)", "file is empty")], id="only-comments"),
        pytest.param(
            "- a\n- b\n",
            [("(file)", "top level must be a mapping (a HerdJob), got a list")],
            id="list-at-top",
        ),
        pytest.param(
            "just text\n",
            [("(file)", "top level must be a mapping (a HerdJob), got string 'just text'")],
            id="scalar-at-top",
        ),
        pytest.param(
            GOOD + "---\n" + GOOD,
            [("(file)", "contains 2 YAML documents; put one HerdJob per file")],
            id="two-documents",
        ),
        pytest.param(
            "spec: !!python/object/apply:os.system [echo]\n",
            [
                (
                    "(file)",
                    "YAML error at line 1, column 7: could not determine a constructor for the "
                    "tag 'tag:yaml.org,2002:python/object/apply:os.system'",
                )
            ],
            id="unsafe-tag",
        ),
    ],
)
def test_invalid_specs_have_exact_errors(text: str, expected: list[tuple[str, str]]) -> None:
    assert problems(text) == expected


def test_trailing_document_separator_is_not_a_second_document() -> None:
    assert load_spec_text(GOOD + "---\n", "x.yaml").valid


def test_alias_bomb_is_rejected_before_validation() -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]
    text = "\n".join(lines) + "\n"
    assert problems(text) == [
        (
            "(file)",
            "more than 100000 values once YAML aliases and merge keys are expanded (or an alias"
            " refers to itself)",
        )
    ]


def test_a_merge_key_bomb_is_refused_before_anything_is_built() -> None:
    """Nested merges of one anchor four times over: 600 bytes standing for 4**13 pairs. PyYAML
    6.0.3 flattened them in exponential time (7 s at 11 levels here, five times more with
    each level); the document is sized on its composed nodes first, each node once."""
    lines = ["a0: &a0 {k0: v}"]
    lines += [f"a{i}: &a{i} {{<<: [*a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}], k{i}: v}}"
              for i in range(1, 14)]  # fmt: skip
    text = "\n".join(lines) + "\n"
    assert len(text) < 700
    assert problems(text) == [
        (
            "(file)",
            "more than 100000 values once YAML aliases and merge keys are expanded (or an alias"
            " refers to itself)",
        )
    ]


def test_merge_keys_and_aliases_of_an_ordinary_size_still_load() -> None:
    text = job_yaml(
        "merged",
        "{command: [x], gpus: {min: 1, max: 2}, env: {<<: &common {A: '1', B: '2'}, C: '3'},"
        " policy: {name: static, params: {}}}",
    )
    loaded = load_spec_text(text, "x.yaml")
    assert loaded.job is not None, loaded.errors
    assert dict(loaded.job.spec.env) == {"A": "1", "B": "2", "C": "3"}


def test_the_yaml_floor_is_the_release_that_flattens_merges_in_linear_time() -> None:
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    (yaml_requirement,) = [
        Requirement(text)
        for text in project["project"]["dependencies"]
        if Requirement(text).name.lower() == "pyyaml"
    ]
    assert "6.0.3" not in yaml_requirement.specifier
    assert "6.0.4" in yaml_requirement.specifier


def test_self_referential_alias_is_rejected() -> None:
    text = job_yaml("a", "{command: [x], gpus: {min: 1, max: 1}, policy: {params: &p {p: *p}}}")
    loaded = load_spec_text(text, "x.yaml")
    assert loaded.name == "a"
    assert [e.message for e in loaded.errors] == [
        "nested more than 64 levels deep (or a YAML alias refers to itself)"
    ]


# libyaml (used when PyYAML has it) and the pure-Python parser word syntax errors
# differently; where they are, and why, is what must be right either way.
@pytest.mark.parametrize(
    ("text", "where", "why"),
    [
        (
            HEADER + "metadata:\n  name: a\nspec: {command: [x], gpus: {min: 1, max: 1}\n",
            "YAML syntax error at line 6, column 1: ",
            ("expected ',' or '}'", "(while parsing a flow mapping at line 5, column 7)"),
        ),
        (
            "metadata:\n  name: a\n   bad: indent\n",
            "YAML syntax error at line 3, column 7: ",
            ("mapping values are not allowed",),
        ),
    ],
    ids=["unclosed-flow-mapping", "bad-indentation"],
)
def test_syntax_errors_say_where_and_why(text: str, where: str, why: tuple[str, ...]) -> None:
    [(field, message)] = problems(text)
    assert field == "(file)"
    assert message.startswith(where), message
    assert all(part in message for part in why), message


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("2024-02-30", "'2024-02-30' is not a valid timestamp (day is out of range for month)"),
        ("!!int abc", "'abc' is not a valid int (invalid literal for int() with base 10: 'abc')"),
        ("!!bool abc", "'abc' is not a valid bool ("),
        ("!!timestamp abc", "'abc' is not a valid timestamp ("),
        ("9" * 5000, "is not a valid int (Exceeds the limit (4300 digits)"),
    ],
    ids=["impossible-date", "int-tag", "bool-tag", "timestamp-tag", "5000-digit-int"],
)
def test_a_value_yaml_parses_but_cannot_build_is_a_spec_error(value: str, message: str) -> None:
    # PyYAML raises ValueError, KeyError or AttributeError for these, not a YAMLError.
    [(field, said)] = problems(
        job_yaml("a", f"{{command: [x], gpus: {{min: 1, max: 1}}, priority: {value}}}")
    )
    assert field == "(file)"
    assert said.startswith("YAML error at line 4, column "), said
    assert message in said, said
    assert len(said) < 200, "a long value is clipped, not repeated in every log line"


@pytest.mark.parametrize(
    ("spec", "field", "message"),
    [
        ("gpus: {min: 1, max: 1%s}" % ("0" * 400), "spec.gpus.max", "less than or equal to 65536"),
        (
            "gpus: {min: 1, max: 1}, priority: 2000000",
            "spec.priority",
            "less than or equal to 1000000",
        ),
        (
            "gpus: {min: 1, max: 1}, policy: {name: static, params: {x: 0x%s}}" % ("f" * 5000),
            "spec.policy.params",
            "x: integers must be within +-2^63, got one of 20000 bits",
        ),
        (
            "gpus: {min: 1, max: 1}, restartPolicy: {backoffLimit: 10000000}",
            "spec.restartPolicy.backoffLimit",
            "less than or equal to 1000000",
        ),
    ],
    ids=["huge-max", "huge-priority", "huge-param", "huge-backoff"],
)
def test_every_integer_has_an_upper_bound(spec: str, field: str, message: str) -> None:
    [(said_field, said)] = problems(job_yaml("a", f"{{command: [x], {spec}}}"))
    assert said_field == field
    assert message in said, said


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ('{command: ["py\\0thon"], gpus: {min: 1, max: 1}}', "spec.command[0]"),
        ('{command: [x], env: {A: "a\\0b"}, gpus: {min: 1, max: 1}}', "spec.env.A"),
        ('{command: [x], workingDir: "/tmp\\0x", gpus: {min: 1, max: 1}}', "spec.workingDir"),
    ],
    ids=["command", "env", "workingDir"],
)
def test_a_nul_byte_that_could_never_launch_is_refused(spec: str, field: str) -> None:
    [(said_field, said)] = problems(job_yaml("a", spec))
    assert said_field == field
    assert "must not contain a NUL byte" in said, said


def test_an_unforeseen_loader_error_is_a_spec_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(text: str, file: str) -> SpecFile:
        raise LookupError("a bug nobody foresaw")

    monkeypatch.setattr(loading, "_load_spec_text", broken)
    [(field, message)] = problems(GOOD)
    assert (field, message) == ("(file)", "cannot be loaded: LookupError: a bug nobody foresaw")


def test_very_deep_nesting_does_not_crash() -> None:
    [(field, message)] = problems("spec: " + "[" * 5000 + "]" * 5000 + "\n")
    assert field == "(file)"
    assert "nested too deeply" in message or "exceeded maximum nesting depth" in message


def test_name_is_recovered_from_an_invalid_file() -> None:
    loaded = load_spec_text(job_yaml("resnet", "{command: [x], gpus: {min: 3, max: 1}}"), "r.yaml")
    assert loaded.name == "resnet"
    assert loaded.job is None
    assert not loaded.valid


def test_name_is_recovered_from_the_first_of_two_documents() -> None:
    assert load_spec_text(GOOD + "---\n" + job_yaml("other"), "r.yaml").name == "resnet"


@pytest.mark.parametrize(
    "text",
    ["", "- a\n", "metadata: 3\n", "metadata: {name: 5}\n", "metadata: {name: ''}\n", "a: [\n"],
)
def test_no_name_when_it_cannot_be_read(text: str) -> None:
    assert load_spec_text(text, "x.yaml").name is None


def test_oversize_file_reports_its_size_and_the_limit(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    path.write_bytes(b"#" * (MAX_SPEC_BYTES + 10))
    assert load_spec_file(path).errors == (
        SpecError(str(path), "(file)", "file is 1048586 bytes, over the limit of 1048576 bytes"),
    )


def test_file_at_the_limit_is_read(tmp_path: Path) -> None:
    path = tmp_path / "padded.yaml"
    path.write_bytes(GOOD.encode() + b"#" * (MAX_SPEC_BYTES - len(GOOD)))
    assert load_spec_file(path).valid


def test_non_utf8_file(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(GOOD.encode() + b"# caf\xe9\n")
    assert [e.message for e in load_spec_file(path).errors] == [
        f"not valid UTF-8 (byte 0xe9 at offset {len(GOOD) + 5})"
    ]


def test_utf8_byte_order_mark_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "bom.yaml"
    path.write_bytes(b"\xef\xbb\xbf" + GOOD.encode())
    assert load_spec_file(path).valid


def test_unreadable_paths(tmp_path: Path) -> None:
    missing = tmp_path / "missing.yaml"
    assert load_spec_file(missing).errors == (
        SpecError(str(missing), "(file)", "cannot read file: No such file or directory"),
    )
    assert [str(e) for e in load_spec_file(tmp_path).errors] == [
        f"{tmp_path}: (file): cannot read file: Is a directory"
    ]


def test_spec_error_str() -> None:
    assert str(SpecError("jobs/a.yaml", "spec.gpus.min", "required")) == (
        "jobs/a.yaml: spec.gpus.min: required"
    )


def test_spec_file_has_a_job_or_errors_never_both_or_neither() -> None:
    valid = load_spec_text(GOOD, "a.yaml")
    with pytest.raises(ValueError, match="either a job or errors"):
        SpecFile(path=Path("a.yaml"), name="resnet", job=None, errors=())
    with pytest.raises(ValueError, match="either a job or errors"):
        SpecFile(
            path=Path("a.yaml"),
            name="resnet",
            job=valid.job,
            errors=(SpecError("a.yaml", "(file)", "x"),),
        )


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("job.yaml", True),
        ("job.yml", True),
        ("JOB.YAML", True),
        ("job.Yml", True),
        (".job.yaml", False),
        (".#job.yaml", False),
        ("#job.yaml#", False),
        ("#job.yaml", False),
        ("job.yaml~", False),
        ("job.yaml.swp", False),
        (".job.yaml.swp", False),
        ("job.yaml.tmp", False),
        ("job.json", False),
        ("yaml", False),
    ],
)
def test_is_spec_filename(name: str, expected: bool) -> None:
    assert is_spec_filename(name) is expected


def test_scan_reads_only_spec_files_sorted_by_name(tmp_path: Path) -> None:
    write(tmp_path, "b.yml", job_yaml("bravo"))
    write(tmp_path, "a.yaml", job_yaml("alpha"))
    write(tmp_path, "c.yaml", "- not a job\n")
    write(tmp_path, ".hidden.yaml", job_yaml("hidden"))
    write(tmp_path, "a.yaml~", job_yaml("backup"))
    write(tmp_path, "notes.txt", "hello")
    (tmp_path / "sub.yaml").mkdir()
    write(tmp_path / "sub.yaml", "nested.yaml", job_yaml("nested"))
    scanned = scan_spec_dir(tmp_path)
    assert [f.path.name for f in scanned] == ["a.yaml", "b.yml", "c.yaml"]
    assert [f.name for f in scanned] == ["alpha", "bravo", None]
    assert [f.valid for f in scanned] == [True, True, False]


def test_scan_skips_a_file_deleted_while_scanning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(tmp_path, "a.yaml", job_yaml("alpha"))
    write(tmp_path, "b.yaml", job_yaml("bravo"))
    load = loading.load_spec_file

    def delete_alpha_then_load(path: Path) -> SpecFile:
        if path.name == "a.yaml":
            path.unlink()
        return load(path)

    monkeypatch.setattr(loading, "load_spec_file", delete_alpha_then_load)
    assert [f.name for f in scan_spec_dir(tmp_path)] == ["bravo"]


def test_scan_passes_over_a_link_that_loops(tmp_path: Path) -> None:
    """`DirEntry.is_file()` raises on a loop (ELOOP) where it says False of a dangling link."""
    write(tmp_path, "a.yaml", job_yaml("alpha"))
    (tmp_path / "self.yaml").symlink_to("self.yaml")
    (tmp_path / "ping.yaml").symlink_to("pong.yaml")
    (tmp_path / "pong.yaml").symlink_to("ping.yaml")
    assert [f.name for f in scan_spec_dir(tmp_path)] == ["alpha"]


def test_scan_of_missing_directory_raises(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=f"^spec directory does not exist: {missing}$"):
        scan_spec_dir(missing)
    a_file = write(tmp_path, "a.yaml", GOOD)
    with pytest.raises(NotADirectoryError, match=f"^spec directory is not a directory: {a_file}$"):
        scan_spec_dir(a_file)


def test_index_sorts_files_into_jobs_invalid_and_unnamed(tmp_path: Path) -> None:
    write(tmp_path, "a.yaml", job_yaml("alpha"))
    write(tmp_path, "b.yaml", job_yaml("bravo", "{command: [x]}"))
    write(tmp_path, "c.yaml", "a: [\n")
    index = index_specs(scan_spec_dir(tmp_path))
    assert list(index.jobs) == ["alpha"]
    assert index.jobs["alpha"].path == tmp_path / "a.yaml"
    assert index.invalid == {
        "bravo": (SpecError(str(tmp_path / "b.yaml"), "spec.gpus", "required"),)
    }
    assert [(e.file, e.field) for e in index.unnamed] == [(str(tmp_path / "c.yaml"), "(file)")]


def test_duplicate_names_make_every_declaring_file_an_error(tmp_path: Path) -> None:
    write(tmp_path, "one.yaml", job_yaml("resnet"))
    write(tmp_path, "two.yaml", job_yaml("resnet"))
    write(tmp_path, "three.yaml", job_yaml("resnet", "{command: [x]}"))
    write(tmp_path, "other.yaml", job_yaml("other"))
    index = index_specs(scan_spec_dir(tmp_path))
    assert list(index.jobs) == ["other"]
    one, two, three = (str(tmp_path / name) for name in ("one.yaml", "two.yaml", "three.yaml"))
    assert index.invalid == {
        "resnet": (
            SpecError(one, "metadata.name", "'resnet' is also declared in three.yaml, two.yaml"),
            SpecError(three, "metadata.name", "'resnet' is also declared in one.yaml, two.yaml"),
            SpecError(three, "spec.gpus", "required"),
            SpecError(two, "metadata.name", "'resnet' is also declared in one.yaml, three.yaml"),
        )
    }
    assert index.unnamed == ()


def test_index_of_nothing_is_empty() -> None:
    index = index_specs([])
    assert (index.jobs, index.invalid, index.unnamed) == ({}, {}, ())


@pytest.mark.timeout(60)
def test_a_bad_value_behind_an_alias_tree_is_found_without_walking_every_path() -> None:
    """Aliases share nodes: 8 levels of 10 made the search for the bad value take ~100 s.
    Such a tree is now refused for its size before anything is built (sized once per node);
    one under the bound still gets the bad value's own message."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    deep = lines + [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]
    [(field, message)] = problems("\n".join(deep) + "\nbad: 2024-02-30\n")
    assert (field, message.split(" once ")[0]) == ("(file)", "more than 100000 values")
    shallow = lines + [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in (1, 2)]
    [(field, message)] = problems("\n".join(shallow) + "\nbad: 2024-02-30\n")
    assert field == "(file)"
    assert message.startswith("YAML error at line 4, column 6: '2024-02-30' is not a valid"), (
        message
    )
