// Visits dashboard pages in headless Chromium as one signed-in browser: for each page its DOM, a
// screenshot and the axe-core accessibility violations, printed as one JSON document.
//   node tests/browser/pages.cjs <sign-in URL> <out dir> <path>...
// The first page is wherever the sign-in link lands; every <path> is then visited with the session.
// Needs EXPORTD_BROWSER_TOOLS (playwright-core and axe-core, installed by scripts/test).
const path = require("path");
const fs = require("fs");

const tools = process.env.EXPORTD_BROWSER_TOOLS;
const { chromium } = require(path.join(tools, "node_modules", "playwright-core"));
const axeSource = fs.readFileSync(path.join(tools, "node_modules", "axe-core", "axe.min.js"), "utf8");

async function main() {
  const [signIn, outDir, ...paths] = process.argv.slice(2);
  const browser = await chromium.launch({
    executablePath: process.env.EXPORTD_CHROMIUM_PATH || "/usr/bin/chromium",
    args: ["--no-sandbox", "--disable-gpu"],
  });
  // The pages' CSP forbids every script; axe is the test's, not the page's.
  const context = await browser.newContext({ bypassCSP: true, viewport: { width: 1280, height: 900 } });
  const page = await context.newPage();
  const results = [];
  const visit = async (url, name) => {
    const response = await page.goto(url, { waitUntil: "load" });
    const dom = await page.content();
    await page.screenshot({ path: path.join(outDir, `${name}.png`), fullPage: true });
    await page.addScriptTag({ content: axeSource });
    const axe = await page.evaluate(() => window.axe.run(document, { resultTypes: ["violations"] }));
    const violations = axe.violations.map((v) => ({
      id: v.id,
      impact: v.impact,
      help: v.help,
      nodes: v.nodes.slice(0, 3).map((n) => n.target.join(" ")),
    }));
    results.push({ url: page.url(), status: response.status(), dom, violations, screenshot: `${name}.png` });
  };
  await visit(signIn, "dashboard");
  const origin = new URL(signIn).origin;
  for (const [i, p] of paths.entries()) {
    await visit(origin + p, `page-${i + 1}`);
  }
  await browser.close();
  process.stdout.write(JSON.stringify(results));
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
