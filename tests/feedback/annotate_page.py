"""One pairwise annotation made the way a person makes it: in Label Studio's own labeling page, in headless
Chromium (Playwright driving Debian's chromium). Run by tests/feedback/test_labelstudio.py with the Label Studio
venv's Python (Playwright lives there, beside Label Studio, not in the project's lock):

    annotate_page.py URL EMAIL PASSWORD PROJECT TASK SIDE SCREENSHOT

logs in, opens the task, clicks the answer on SIDE (left: answer1, right: answer2) as an annotator clicks it,
keeps a screenshot of the page with the choice made, presses Submit and waits for Label Studio to store the
annotation. Prints the stored annotation's JSON."""

from __future__ import annotations

import json
import shutil
import sys

from playwright.sync_api import sync_playwright

LIMIT_MS = 120_000  # a first page load compiles nothing, but 2 busy cores make it slow


def main(url: str, email: str, password: str, project: str, task: str, side: str, screenshot: str) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        sys.exit("no chromium on PATH")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.set_default_timeout(LIMIT_MS)
        page.goto(f"{url}/user/login/")
        page.fill("input[name=email]", email)
        page.fill("input[name=password]", password)
        page.click("button[type=submit]")
        page.wait_for_url(lambda now: "/user/login" not in now)
        page.goto(f"{url}/projects/{project}/data?task={task}")
        # the three Text objects in LABEL_CONFIG's order: the prompt, answer1, answer2; the Pairwise control
        # makes the two answers clickable
        texts = page.locator(".lsf-richtext__container")
        texts.nth(2).wait_for()
        texts.nth(1 if side == "left" else 2).click()
        page.screenshot(path=screenshot)
        with page.expect_response(lambda r: r.request.method == "POST" and "/annotations" in r.url) as stored:
            page.get_by_role("button", name="Submit").click()
        print(json.dumps(stored.value.json()))
        browser.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
