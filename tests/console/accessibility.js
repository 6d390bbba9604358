() => {
  // What every view of the console must satisfy, run in the page by
  // test_browser.py; returns the problems found (none: an empty list).
  // Inputs labelled; bars, images, links and buttons named; bars with a maximum
  // and a value; ids unique; the landmarks and one h1; text contrast of at
  // least 4.5:1 (3:1 for large text) against the first opaque background.
  const problems = [];
  const text = (el) => (el.textContent || '').trim();
  const named = (el) => Boolean(
    (el.getAttribute('aria-label') || '').trim()
    || (el.getAttribute('aria-labelledby') || '').split(/\s+/).some(
      (id) => id && document.getElementById(id) && text(document.getElementById(id)))
    || (el.labels && [...el.labels].some((l) => text(l)))
    || (el.getAttribute('title') || '').trim());
  for (const el of document.querySelectorAll('input, select, textarea')) {
    if (el.type !== 'hidden' && !named(el)) problems.push(`unlabelled ${el.outerHTML.slice(0, 100)}`);
  }
  for (const el of document.querySelectorAll('[role="progressbar"], progress, meter')) {
    if (!named(el)) problems.push(`unnamed bar ${el.outerHTML.slice(0, 100)}`);
    if (!el.hasAttribute('aria-valuemax')) problems.push(`bar without a maximum ${el.outerHTML.slice(0, 100)}`);
    if (!el.hasAttribute('aria-valuenow') && !el.getAttribute('aria-valuetext')) {
      problems.push(`bar without a value ${el.outerHTML.slice(0, 100)}`);
    }
  }
  for (const el of document.querySelectorAll('img, svg, [role="img"]')) {
    if (el.getAttribute('aria-hidden') !== 'true' && !el.getAttribute('alt') && !named(el)) {
      problems.push(`image without a name ${el.outerHTML.slice(0, 100)}`);
    }
  }
  for (const el of document.querySelectorAll('a[href], button')) {
    if (!text(el) && !named(el)) problems.push(`nameless control ${el.outerHTML.slice(0, 100)}`);
  }
  const ids = [...document.querySelectorAll('[id]')].map((el) => el.id);
  for (const id of new Set(ids.filter((id, i) => ids.indexOf(id) !== i))) problems.push(`duplicate id ${id}`);
  for (const [sel, n] of [['header[role="banner"], [role="banner"]', 1], ['nav', 1], ['main', 1], ['h1', 1]]) {
    if (document.querySelectorAll(sel).length < n) problems.push(`missing ${sel}`);
  }
  if (document.querySelectorAll('h1').length !== 1) problems.push('not exactly one h1');

  const rgb = (c) => (c.match(/[\d.]+/g) || []).map(Number);
  const luminance = ([r, g, b]) => {
    const f = (v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; };
    return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b);
  };
  const background = (el) => {
    for (let e = el; e; e = e.parentElement) {
      const c = rgb(getComputedStyle(e).backgroundColor);
      if (c.length >= 3 && (c.length < 4 || c[3] === 1)) return c;
    }
    return [255, 255, 255];
  };
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  const checked = new Set();
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    const el = node.parentElement;
    if (!node.textContent.trim() || checked.has(el)) continue;
    checked.add(el);
    const box = el.getBoundingClientRect();
    const style = getComputedStyle(el);
    if (box.width <= 1 || box.height <= 1 || style.visibility === 'hidden' || el.closest('dialog:not([open])')) continue;
    const fg = luminance(rgb(style.color));
    const bg = luminance(background(el));
    const ratio = (Math.max(fg, bg) + 0.05) / (Math.min(fg, bg) + 0.05);
    const size = parseFloat(style.fontSize);
    const large = size >= 24 || (size >= 18.66 && Number(style.fontWeight) >= 700);
    if (ratio < (large ? 3 : 4.5)) problems.push(`contrast ${ratio.toFixed(2)} of "${text(el).slice(0, 40)}"`);
  }
  return problems;
}
