"""The side-by-side benches' rounds and table (benchmarks/side_by_side.py): both clusters get the
same fresh prompt per round and pipeline, who goes first alternates, and the table prints the
medians of what came back."""

from __future__ import annotations

from benchmarks import side_by_side


async def test_each_round_sends_both_settings_the_same_prompt_and_alternates_who_goes_first(monkeypatch):
    sent = []

    async def one(url, model, prompt, pipeline, tokens):
        sent.append((url, pipeline, tuple(prompt)))
        return {"ttft": float(len(sent)), "text": url}

    monkeypatch.setattr(side_by_side, "one", one)
    got = await side_by_side.rounds({True: "on", False: "off"}, "m", ["p-md", "p-rld"], 3, 5, 4, "test")
    assert [u for u, _, _ in sent] == ["on", "off", "on", "off", "off", "on", "off", "on", "on", "off", "on", "off"]
    for i in range(0, len(sent), 2):  # each pair: one pipeline, one prompt, both settings
        assert sent[i][1:] == sent[i + 1][1:] and len(sent[i][2]) == 5
    assert len({p for _, _, p in sent}) == 6  # a fresh prompt per round and pipeline
    assert [x["ttft"] for x in got[(True, "p-md")]] == [1.0, 6.0, 9.0]


def test_the_table_prints_each_settings_median_and_range(capsys):
    got = {(s, "p-md"): [{"ttft": t} for t in (10.0, 30.0, 20.0)] for s in (True, False)}
    side_by_side.table(got, ["p-md"], "lend", {"TTFT": "ttft"})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["pipeline", "lend", "TTFT"]
    assert lines[1].split() == ["p-md", "true", "20", "[10..30]"]
    assert lines[2].split()[:2] == ["p-md", "false"]
