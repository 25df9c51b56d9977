#!/usr/bin/env python3
"""mpusim's pages in a real browser: Debian's chromium, headless, driven by Selenium.

What it checks, on pages written by `mpusim layout CONFIG --format html`:
  - the page draws one GPU cell per rank;
  - choosing a group kind in the page's menu and clicking a GPU (real clicks through
    WebDriver) outlines exactly the ranks of that GPU's group of the chosen kind, which must
    equal what `mpusim layout CONFIG --rank R --format json` says; choosing another kind
    afterwards moves the outline to that kind's group;
  - the text shown for the clicked GPU lists its coordinates and every group the planner puts
    it in;
  - a link ending in #kind=K&rank=R opens with that choice made;
  - the 1024-rank GPT-3 page loads and answers a click (its times are printed).
It checks that the layout page of a pipeline config draws its schedule, and that the timeline
page of `mpusim run --trace FILE.html` draws a slice per trace event with a row per rank and
zooms, and that the estimate page draws each stage's bar as long against the GPU's memory as
its peak is. It writes screenshots for the docs into OUT_DIR: the layout page, the schedule
SVGs of 1F1B and of the interleaved schedule, the timeline page, and the estimate and advise
pages.

Usage: pages_test.py MPUSIM MPIEXEC CHROMIUM CHROMEDRIVER SAMPLE_CONFIG_DIR OUT_DIR
"""
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select

mpusim, mpiexec, chromium, chromedriver, samples, out = sys.argv[1:7]
# mpusim runs from the sample folder's parent with relative paths, so that the pages (and the
# screenshots) name sample_configs/NAME.json, not this machine's checkout.
root = pathlib.Path(samples).resolve().parent
samples = pathlib.Path(pathlib.Path(samples).resolve().name)
out = pathlib.Path(out)
work = pathlib.Path(tempfile.mkdtemp(prefix="mpusim-browser-"))
failures = []


def fail(message):
    print("FAIL: " + message, file=sys.stderr)
    failures.append(message)


def mpusim_output(*args):
    return subprocess.run([mpusim, *args], check=True, capture_output=True, text=True,
                          cwd=root).stdout


def write_page(config, name):
    page = work / name
    page.write_text(mpusim_output("layout", str(config), "--format", "html"))
    return page


def planner_groups(config, rank):
    """kind -> the ranks of RANK's group of that kind, from `mpusim layout --rank R`."""
    report = json.loads(mpusim_output("layout", str(config), "--rank", str(rank), "--format", "json"))
    return {kind: sorted(group["ranks"]) for kind, group in report["groups"].items() if group}


def outlined(driver):
    """The ranks whose cells carry the page's outline (class peer), and the chosen cell's."""
    classes = driver.execute_script(
        "return Array.from(document.querySelectorAll('.gpu'), c => [c.id, c.className]);")
    peers = sorted(int(i[1:]) for i, c in classes if "peer" in c.split())
    chosen = [int(i[1:]) for i, c in classes if "chosen" in c.split()]
    return len(classes), peers, chosen


options = webdriver.ChromeOptions()
options.binary_location = chromium
for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1100,600"):
    options.add_argument(argument)
driver = webdriver.Chrome(service=Service(chromedriver), options=options)
driver.set_page_load_timeout(120)
driver.set_script_timeout(120)


def click_check(config, page, clicks):
    """Load PAGE, then for each (kind, rank): choose KIND in the menu, click g<rank>, and
    compare the outline with the planner's group."""
    start = time.monotonic()
    driver.get(page.as_uri())
    loaded = time.monotonic() - start
    world_size = json.loads(driver.find_element(By.ID, "layout").get_attribute("textContent"))[
        "world_size"]
    cells, _, _ = outlined(driver)
    if cells != world_size:
        fail(f"{config.name}: {cells} GPU cells drawn for {world_size} ranks")
    menu = Select(driver.find_element(By.ID, "kind"))
    for kind, rank in clicks:
        expected = planner_groups(config, rank)
        menu.select_by_value(kind)
        start = time.monotonic()
        driver.find_element(By.ID, f"g{rank}").click()
        _, clicked_peers, chosen = outlined(driver)
        clicked = time.monotonic() - start
        peers = clicked_peers
        if chosen != [rank]:
            fail(f"{config.name}: after clicking g{rank} the chosen cells are {chosen}")
        if peers != expected.get(kind):
            fail(f"{config.name}: clicking g{rank} with kind {kind} outlines {peers}, "
                 f"its {kind} group is {expected.get(kind)}")
        info = driver.find_element(By.ID, "info").text
        if f"rank {rank} on node" not in info:
            fail(f"{config.name}: no coordinates for rank {rank} in {info!r}")
        for other in expected:
            if f"\n{other} group " not in "\n" + info:
                fail(f"{config.name}: the text for g{rank} does not list its {other} group")
        # With a pipeline the schedule outlines the clicked GPU's stage: its pp rank's row.
        stages = driver.execute_script(
            "return Array.from(document.querySelectorAll('rect.stage.mine'), e => e.dataset.pp)")
        pp = json.loads(driver.find_element(By.ID, "layout").get_attribute("textContent"))[
            "coordinates"][rank][5]
        has_schedule = driver.execute_script("return document.querySelectorAll('rect.stage').length") > 0
        if has_schedule and stages != [str(pp)]:
            fail(f"{config.name}: clicking g{rank} (pp {pp}) outlines the schedule rows {stages}")
        # Another kind, without clicking again: the outline follows the menu.
        for other, ranks in expected.items():
            if other != kind:
                menu.select_by_value(other)
                _, other_peers, _ = outlined(driver)
                if other_peers != ranks:
                    fail(f"{config.name}: g{rank} chosen, kind {other}: outlines {other_peers}, "
                         f"its {other} group is {ranks}")
                break
        print(f"ok: {config.name}: {cells} GPUs drawn (page loaded in {loaded:.2f} s); "
              f"clicking g{rank} with {kind} chosen outlines {peers if len(peers) <= 16 else str(len(peers)) + ' ranks'} "
              f"({clicked:.2f} s)")


lab = samples / "lab_t2_p4_n16.json"
lab_page = write_page(lab, "lab.html")
click_check(lab, lab_page, [("pp", 5), ("dp", 6), ("tp", 11)])
gpt3 = samples / "gpt3_175b_t8_p16_n1024.json"
click_check(gpt3, write_page(gpt3, "gpt3.html"), [("dp", 1000), ("pp", 3)])

# A link chooses for the reader.
driver.get(lab_page.as_uri() + "#kind=pp&rank=5")
_, peers, chosen = outlined(driver)
if chosen != [5] or peers != planner_groups(lab, 5)["pp"]:
    fail(f"#kind=pp&rank=5 opens with g{chosen} chosen and {peers} outlined")
else:
    print(f"ok: #kind=pp&rank=5 opens with g5 chosen and its pp group {peers} outlined")

# Screenshots for the README and docs/labs.md.
driver.set_window_size(1100, 420)
driver.get(lab_page.as_uri() + "#kind=tp&rank=5")
driver.save_screenshot(str(out / "layout_page.png"))
pipeline = samples / "gpt_pipeline_p4_v2_n4.json"
driver.get(write_page(pipeline, "pipeline.html").as_uri())
if not driver.find_elements(By.TAG_NAME, "svg"):
    fail(f"{pipeline.name}: the layout page of a pipeline draws no schedule")


def schedule_shot(name, *args):
    """Screenshot of `mpusim schedule ARGS --format svg`, the window sized to the picture."""
    svg = work / (name + ".svg")
    svg.write_text(mpusim_output("schedule", *args, "--format", "svg"))
    driver.set_window_size(1100, 400)
    driver.get(svg.as_uri())
    box = driver.find_element(By.TAG_NAME, "svg")
    width, height = int(box.get_attribute("width")), int(box.get_attribute("height"))
    driver.set_window_size(width + 40, height + 140)  # the window's frame is not the page's
    driver.get(svg.as_uri())
    driver.save_screenshot(str(out / (name + ".png")))


schedule_shot("schedule_1f1b", "--world-size", "4", "--pp", "4", "--microbatches", "8")
schedule_shot("schedule_interleaved", str(pipeline))
# The timeline page of a run (--trace FILE.html): a slice drawn per complete event, the zoom
# menu widening the drawing.
trace_page = work / "trace.html"
subprocess.run([mpiexec, "-n", "4", "--oversubscribe", mpusim, "run",
                str(samples / "gpt_pipeline_p2_v2_t2_n4.json"), "--no-check", "--trace",
                str(trace_page)], check=True, capture_output=True, cwd=root,
               env={**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1",
                    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
driver.set_window_size(1450, 620)
driver.get(trace_page.as_uri())
events = json.loads(driver.find_element(By.ID, "trace").get_attribute("textContent"))["traceEvents"]
complete = [e for e in events if e["ph"] == "X"]
drawn = driver.execute_script("return document.querySelectorAll('#timeline g.slice').length")
if drawn != len(complete):
    fail(f"trace page: {drawn} slices drawn for {len(complete)} complete events")
rows = driver.execute_script(
    "return Array.from(document.querySelectorAll('#timeline text'), t => t.textContent)"
    ".filter(t => t.startsWith('rank '))")
if rows != [f"rank {r} (tp {r % 2}, pp {r // 2}, dp 0)" for r in range(4)]:
    fail(f"trace page: the rows are {rows}")
# Each row's compute share: its forward and backward time over the step, from the events.
shares = driver.execute_script(
    "return Array.from(document.querySelectorAll('#timeline text'), t => t.textContent)"
    ".filter(t => t.startsWith('compute '))")
end = max(e["ts"] + e["dur"] for e in complete)
busy = [sum(e["dur"] for e in complete if e["tid"] == r and e["cat"] in ("forward", "backward"))
        for r in range(4)]
expected_shares = [f"compute {math.floor(100 * b / end + 0.5)}%" for b in busy]  # Math.round
if shares != expected_shares:
    fail(f"trace page: the rows' compute shares are {shares}, the events give {expected_shares}")
width = float(driver.find_element(By.CSS_SELECTOR, "#timeline svg").get_attribute("width"))
driver.save_screenshot(str(out / "trace_page.png"))
Select(driver.find_element(By.ID, "zoom")).select_by_value("4")
wider = float(driver.find_element(By.CSS_SELECTOR, "#timeline svg").get_attribute("width"))
if not wider > 3 * width - 600:
    fail(f"trace page: zoom 4x draws {wider} px wide, 1x {width} px")
print(f"ok: trace page: {drawn} slices drawn for {len(complete)} events, rows {rows[0]} ... "
      f"{rows[-1]}, {' '.join(shares)}; zoom 4x: {width:.0f} -> {wider:.0f} px")

# The estimate's page (`mpusim estimate --format html`): each stage's bar, as the browser lays
# it out, is as long against the GPU-memory line as the stage's peak and reserve are against
# the GPU's memory in the JSON the page embeds.
estimate_args = [str(gpt3), "--global-batch-size", "1536", "--gpu", "a100-80gb"]
estimate_page = work / "estimate.html"
estimate_page.write_text(mpusim_output("estimate", *estimate_args, "--format", "html"))
report = json.loads(mpusim_output("estimate", *estimate_args, "--format", "json"))
driver.set_window_size(1000, 900)
driver.get(estimate_page.as_uri())
memory_svg = driver.find_elements(By.TAG_NAME, "svg")[0]
line = memory_svg.find_element(By.TAG_NAME, "line").rect
rows = {}
for rect in memory_svg.find_elements(By.TAG_NAME, "rect"):
    box = rect.rect
    rows.setdefault(round(box["y"]), []).append(box)
starts = {min(b["x"] for b in boxes) for boxes in rows.values()}
if len(rows) != len(report["stages"]) or len(starts) != 1:
    fail(f"estimate page: {len(rows)} bars starting at {starts} for {len(report['stages'])} stages")
else:
    start = starts.pop()
    worst = 0.0
    for (y, boxes), stage in zip(sorted(rows.items()), report["stages"]):
        drawn = sum(b["width"] for b in boxes) / (line["x"] + line["width"] / 2 - start)
        wanted = (stage["memory"]["peak"] + stage["reserved_bytes"]) / report["hbm_bytes"]
        worst = max(worst, abs(drawn - wanted))
    if worst > 0.005:
        fail(f"estimate page: a bar's length against the memory line is {worst:.4f} off its peak")
    else:
        print(f"ok: estimate page: {len(rows)} stage bars drawn as long as their peaks and "
              f"reserves against "
              f"the GPU's memory (largest difference {worst:.4f} of it)")
driver.save_screenshot(str(out / "estimate_page.png"))
advise_page = work / "advise.html"
advise_page.write_text(mpusim_output("advise", str(gpt3), "--global-batch-size", "1536", "--gpu",
                                     "a100-80gb", "--top", "6", "--format", "html"))
driver.set_window_size(1100, 800)
driver.get(advise_page.as_uri())
driver.save_screenshot(str(out / "advise_page.png"))
shots = ("layout_page.png", "schedule_1f1b.png", "schedule_interleaved.png", "trace_page.png",
         "estimate_page.png", "advise_page.png")
for shot in shots:
    if (out / shot).stat().st_size == 0:
        fail(f"empty screenshot {shot}")
print(f"ok: screenshots in {out}: {' '.join(shots)}")
driver.quit()
sys.exit(1 if failures else 0)
