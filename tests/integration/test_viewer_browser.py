"""The viewer in headless Chromium over tool-using rollouts: transcript, tool calls and outputs, diffs,
reward parts, filters, the per-token view, hostile markup shown as text, two evaluations side by side.

The folders come from `tests/viewer_folders.py` (the real arithmetic environment and loop
bookkeeping); tests/e2e/test_viewer_run.py does the same over a real CPU training run and a
real `agentrl eval`. Screenshots go to the test's temporary folder.
"""

from __future__ import annotations

import pytest

from tests.browser import (
    CHART_TITLES,
    browser_errors,
    chart_titles,
    chromium_or_skip,
    count,
    open_page,
    texts,
    wait_for,
)
from tests.viewer_folders import HOSTILE, arithmetic_eval, arithmetic_run, trained_run

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def viewer(tmp_path_factory):
    pytest.importorskip("uvicorn", reason="the view extra (starlette, uvicorn) is not installed")
    from agentrl.viewer.serve import ViewerServer

    root = tmp_path_factory.mktemp("folders")
    arithmetic_run(root / "run")
    arithmetic_eval(root / "eval-base", right_every=3)
    arithmetic_eval(root / "eval-tuned", right_every=1)
    arithmetic_eval(root / "eval-tuned-baseline", right_every=3)  # as `agentrl eval --model RUN/.../step_N` names it
    with ViewerServer([root]) as server:
        yield server


@pytest.fixture(scope="module")
def driver():
    browser = chromium_or_skip()
    try:
        yield browser
    finally:
        browser.quit()


def _ids(driver, viewer) -> dict[str, str]:
    open_page(driver, viewer.url + "#/")
    return driver.execute_script(
        "return Object.fromEntries([...document.querySelectorAll('#folders tbody tr')]"
        ".map(tr => [tr.querySelector('a').textContent, tr.dataset.folder]));")


def test_a_tool_using_rollout_with_its_diff_and_reward_parts(driver, viewer, tmp_path):
    run = _ids(driver, viewer)["run"]
    open_page(driver, viewer.url + f"#/f/{run}")
    assert chart_titles(driver) == CHART_TITLES  # every chart drawn, the held-out one included
    assert count(driver, "#rollout-list tbody tr") == 18
    assert driver.execute_script("return document.getElementById('f-next').disabled")  # one page of 18
    driver.find_element("css selector", "#rollout-list tbody tr[data-n='0'] a").click()
    wait_for(driver, f"document.body.dataset.ready === '#/f/{run}/r/0'")
    transcript = driver.find_element("id", "transcript").text
    assert "calculator" in transcript and "TOOL" in transcript and "Let me compute." in transcript
    tool_output = driver.execute_script(
        "return [...document.querySelectorAll('.role-tool pre')].map(p => p.textContent).join('\\n')")
    assert HOSTILE in tool_output  # shown as text ...
    assert driver.execute_script("return document.body.dataset.pwned") is None  # ... never run
    assert count(driver, "#transcript img, #transcript script") == 0
    added, removed = texts(driver, "#state pre.diff .diff-add"), texts(driver, "#state pre.diff .diff-del")
    assert added == ["+    return a + b\n"] and removed == ["-    return a - b\n"]
    reward = driver.find_element("id", "reward").text
    assert "correct_answer" in reward and "tool_calls" in reward and "advantage" in reward
    tokens, trained = count(driver, "#tokens .tok"), count(driver, "#tokens .tok.loss")
    assert tokens > trained > 0
    driver.find_element("css selector", "button[data-mode='mask']").click()
    assert driver.execute_script("return [...document.querySelectorAll('#tokens .tok.loss')]"
                                 ".every(s => s.style.backgroundColor !== '')")
    driver.find_element("css selector", "button[data-mode='mismatch']").click()
    assert "no trainer logprobs" in driver.find_element("id", "token-note").text
    driver.save_screenshot(str(tmp_path / "rollout.png"))
    assert browser_errors(driver) == []


def test_the_per_token_view_colours_trainer_vs_inference_mismatch(driver, tmp_path):
    pytest.importorskip("torch", reason="the train extra (torch) is not installed")
    from agentrl.viewer.serve import ViewerServer

    path, _ = trained_run(tmp_path / "trained", steps=1, samples_per_step=2)
    with ViewerServer([path]) as server:
        run = _ids(driver, server)["trained"]
        open_page(driver, server.url + f"#/f/{run}/r/0")
        wait_for(driver, f"document.body.dataset.ready === '#/f/{run}/r/0'")
        driver.find_element("css selector", "button[data-mode='mismatch']").click()
        colours = driver.execute_script(
            "return [...document.querySelectorAll('#tokens .tok')].map(s => [s.classList.contains('loss'), "
            "s.style.backgroundColor, s.title])")
        trained = [(colour, title) for loss, colour, title in colours if loss]
        assert trained and all("124, 58, 237" in colour for colour, _ in trained)  # the mismatch hue
        assert all("trainer " in title and "Δ" in title for _, title in trained)
        assert all(colour == "" for loss, colour, _ in colours if not loss)
        assert "no trainer logprobs" not in driver.find_element("id", "token-note").text
        driver.save_screenshot(str(tmp_path / "mismatch.png"))
        assert browser_errors(driver) == []


def test_filters_narrow_the_rollout_list(driver, viewer, tmp_path):
    run = _ids(driver, viewer)["run"]
    open_page(driver, viewer.url + f"#/f/{run}")
    driver.find_element("id", "f-min").send_keys("1")
    wait_for(driver, "!document.getElementById('f-count').textContent.startsWith('18 of 18')")
    rewards = texts(driver, "#rollout-list tbody tr td:nth-child(6)")
    assert rewards and set(rewards) == {"1"}
    from selenium.webdriver.support.ui import Select

    Select(driver.find_element("id", "f-step")).select_by_value("2")
    wait_for(driver, "[...document.querySelectorAll('#rollout-list tbody tr td:nth-child(2)')]"
                     ".every(td => td.textContent === '2')")
    driver.save_screenshot(str(tmp_path / "filtered.png"))


def test_two_evaluations_side_by_side(driver, viewer, tmp_path):
    ids = _ids(driver, viewer)
    open_page(driver, viewer.url + f"#/compare/{ids['eval-base']}/{ids['eval-tuned']}")
    assert count(driver, "#compare-tasks tbody tr") == 4
    wait_for(driver, "document.querySelectorAll('.side').length === 2")
    sides = driver.execute_script(
        "return [...document.querySelectorAll('.side')].map(side => ({label: side.dataset.side, "
        "rollouts: side.querySelectorAll('.side-rollout').length, text: side.textContent}))")
    assert [s["label"] for s in sides] == ["A", "B"] and all(s["rollouts"] == 2 for s in sides)
    assert all("reward" in s["text"] and "<answer>" in s["text"] for s in sides)
    assert "reward 1" in sides[1]["text"]
    driver.save_screenshot(str(tmp_path / "compare.png"))
    open_page(driver, viewer.url + f"#/f/{ids['eval-tuned']}/r/0")  # an evaluation's rollout: no training fields
    wait_for(driver, f"document.body.dataset.ready === '#/f/{ids['eval-tuned']}/r/0'")
    assert count(driver, "button[data-mode='mismatch']") == 0 and count(driver, "button[data-mode='logprob']") == 1
    assert "policy versions" not in driver.find_element("id", "reward").text


def test_a_checkpoint_against_its_baseline_reads_checkpoint_minus_base_sorted_and_summed(driver, viewer, tmp_path):
    ids = _ids(driver, viewer)
    # opened with the checkpoint as A (the CLI's "side by side" order): the page turns it so the base is A
    driver.get(viewer.url + f"#/compare/{ids['eval-tuned']}/{ids['eval-tuned-baseline']}")
    wait_for(driver, f"document.body.dataset.ready === '#/compare/{ids['eval-tuned-baseline']}/{ids['eval-tuned']}'")
    wait_for(driver, "document.querySelector('#compare-summary') !== null")
    names = driver.execute_script("return [...document.querySelectorAll('main p strong')].map(s => s.nextSibling"
                                  ".textContent)")
    assert names[:2] == ["eval-tuned-baseline", "eval-tuned"]
    rows = driver.execute_script("return [...document.querySelectorAll('#compare-tasks tbody tr')].map(tr => "
                                 "({delta: tr.cells[3].textContent, cls: tr.cells[3].className}))")
    assert rows and all(r["cls"] == "num up" for r in rows if r["delta"].startswith("+"))  # better is green
    assert any(r["delta"].startswith("+") for r in rows)
    summary = driver.execute_script("return document.querySelector('#compare-summary').textContent")
    assert "mean over 4 tasks (B better on" in summary
    driver.execute_script("document.querySelector('th[data-column=\"3\"]').click()")
    deltas = driver.execute_script("return [...document.querySelectorAll('#compare-tasks tbody tr')]"
                                   ".map(tr => parseFloat(tr.cells[3].textContent) || 0)")
    assert deltas == sorted(deltas, reverse=True)  # a click on B - A sorts it, largest first
    driver.execute_script("document.querySelector('#compare-tasks tbody tr').click()")
    wait_for(driver, "document.querySelector('#compare-detail').getBoundingClientRect().top < window.innerHeight")
    driver.save_screenshot(str(tmp_path / "compare-checkpoint.png"))


def test_run_charts_have_round_ticks(driver, viewer):
    ids = _ids(driver, viewer)
    open_page(driver, viewer.url + f"#/f/{ids['run']}")
    wait_for(driver, "document.querySelectorAll('svg.chart .tick-y').length > 0")
    labels = driver.execute_script("return [...document.querySelectorAll('svg.chart .tick-y, svg.chart .tick-x')]"
                                   ".map(t => t.textContent)")
    for label in labels:
        digits = label.split("e")[0].lstrip("-").split(".")
        assert len(digits) == 1 or len(digits[1]) <= 4, labels  # no 1516.455
        assert float(label) == float(label)
    per_chart = driver.execute_script("return [...document.querySelectorAll('svg.chart')].map(svg => "
                                      "[...svg.querySelectorAll('.tick-y')].map(t => t.textContent))")
    assert all(len(set(ticks)) == len(ticks) for ticks in per_chart), per_chart  # no repeated label
