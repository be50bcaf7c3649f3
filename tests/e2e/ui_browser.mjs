// Drives the flight recorder in a real headless Chromium (@sparticuz/chromium through playwright-core), the
// way a person would: from the runs page a point of the reward curve, then a rollout with a merge break, then
// the token view of the sample that break started. Prints what it saw as one JSON line; screenshots go to
// the folder given.
//
// Usage: node ui_browser.mjs BASE_URL CREDENTIAL SCREENSHOT_DIR CHROMIUM_PATH
import chromium from "@sparticuz/chromium";
import { chromium as driver } from "playwright-core";

const [base, credential, shots, executable] = process.argv.slice(2);
const browser = await driver.launch({ executablePath: executable, args: chromium.args, headless: true });
const seen = { clicks: [] };
try {
  const page = await browser.newPage({ viewport: { width: 1360, height: 900 } });
  // The credential once, in the address: the answer sets the session cookie and drops it from the address.
  await page.goto(`${base}/?token=${encodeURIComponent(credential)}`);
  seen.runsUrl = page.url();
  seen.runsTitle = await page.title();
  seen.curvePoints = await page.locator("a.point").count();
  await page.screenshot({ path: `${shots}/ui-runs.png` });

  // A point of the reward curve opens its rollouts: look for one that holds a rollout with a merge break.
  for (let i = 0; i < seen.curvePoints; i++) {
    await page.locator("a.point").nth(i).click();
    await page.waitForLoadState("load");
    seen.clicks.push(`point ${i}`);
    if ((await page.locator("#rollouts .tag.break").count()) > 0) break;
    await page.goBack();
  }
  seen.listUrl = page.url();
  const row = page.locator("#rollouts tbody tr", { has: page.locator(".tag.break") }).first();
  const rollout = row.locator("a.rollout-link");
  seen.rollout = (await rollout.textContent()).trim();
  await rollout.click();
  await page.waitForLoadState("load");
  seen.clicks.push(`rollout ${seen.rollout}`);
  seen.rolloutReward = (await page.locator("#reward").textContent()).trim();
  seen.timelineEntries = await page.locator("#timeline > div").count();
  await page.screenshot({ path: `${shots}/ui-rollout.png` });

  // The token view of the sample the merge break started.
  const sampleRow = page.locator("#samples tbody tr", { has: page.locator(".tag.break") }).first();
  const tokens = sampleRow.locator("a.token-link");
  seen.sampleLink = (await tokens.textContent()).trim();
  await tokens.click();
  await page.waitForLoadState("load");
  seen.clicks.push(seen.sampleLink);
  seen.tokenUrl = page.url();
  seen.reward = (await page.locator("#reward").textContent()).trim();
  seen.shownCompletion = Number(await page.locator("#token-count").getAttribute("data-completion"));
  seen.completionSpans = await page.locator("#completion .tok").count();
  seen.trainedSpans = await page.locator("#completion .tok.m1").count();
  seen.contextSpans = await page.locator("#completion .tok.m0").count();
  seen.trainedColour = await page.locator("#completion .tok.m1").first().evaluate((e) => getComputedStyle(e).backgroundColor);
  seen.contextColour = await page.locator("#completion .tok.m0").first().evaluate((e) => getComputedStyle(e).backgroundColor);
  seen.driftReason = (await page.locator("#drift-reason").textContent()).trim();
  await page.screenshot({ path: `${shots}/ui-tokens.png` });
} finally {
  await browser.close();
}
console.log(JSON.stringify(seen));
