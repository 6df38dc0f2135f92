import pytest

from glm53.cli import main


@pytest.mark.parametrize("action", ["pack", "verify", "compare", "probe"])
def test_every_action_has_help(action, capsys):
    with pytest.raises(SystemExit) as info:
        main(["store", action, "--help"])
    assert info.value.code == 0
    assert f"usage: glm53 store {action}" in capsys.readouterr().out


def test_store_help_lists_the_actions_and_exit_codes(capsys):
    with pytest.raises(SystemExit) as info:
        main(["store", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for action in ("pack", "verify", "compare", "probe"):
        assert action in text
    assert "Exit codes: 0 ok, 1 a check failed, 2 usage or environment error" in " ".join(
        text.split()
    )


def test_store_without_an_action_is_a_usage_error(capsys):
    assert main(["store"]) == 2
    assert "usage: glm53 store" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["pack", "--out", "x"],
        ["verify"],
        ["compare", "--store", "x"],
        ["pack", "--model", "m", "--out", "o", "--threads", "0"],
    ],
)
def test_missing_or_bad_arguments_exit_2(argv):
    with pytest.raises(SystemExit) as info:
        main(["store", *argv])
    assert info.value.code == 2


def test_probe_of_a_missing_path_is_a_usage_error(tmp_path, capsys):
    assert main(["store", "probe", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert f"probe: {tmp_path / 'none'} does not exist; give the store file or its directory" in err
