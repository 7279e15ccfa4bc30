// Layout problems of each plotly figure on the page, as the reader sees it (run by
// tests/test_book_browser.py): a title or subtitle clipped or under the mode bar, a menu,
// a subplot title or the legend; a legend over the plot; a timeline whose bars fill
// less than 80% of its time axis. Returns [{title, problems, fig: [width, height]}].
const out = [];
const overlap = (a, b) => a && b && a.width > 0 && b.width > 0 && a.height > 0 && b.height > 0 &&
  a.left < b.right - 1 && b.left < a.right - 1 && a.top < b.bottom - 1 && b.top < a.bottom - 1;
for (const gd of document.querySelectorAll('div.plotly-graph-div')) {
  const fig = gd.getBoundingClientRect();
  const boxes = sel => [...gd.querySelectorAll(sel)].map(e => e.getBoundingClientRect())
                                                    .filter(r => r.width > 0 && r.height > 0);
  const one = sel => boxes(sel)[0] || null;
  const texts = [['title', one('.g-gtitle .gtitle')], ['subtitle', one('.gtitle-subtitle')]];
  const others = [['mode bar', one('.modebar')], ['legend', one('.legend')],
                  ['menu', one('.updatemenu-header')], ['plot area', ...boxes('.nsewdrag').slice(0, 1)],
                  ...boxes('.annotation-text-g').map(b => ['annotation', b])];
  const problems = [];
  for (const [name, box] of texts) {
    if (!box) continue;
    if (box.left < fig.left - 1 || box.right > fig.right + 1 || box.top < fig.top - 1)
      problems.push(`${name} clipped (${Math.round(box.width)} px in ${Math.round(fig.width)})`);
    for (const [other, obox] of others) if (overlap(box, obox)) problems.push(`${name} under ${other}`);
  }
  if (overlap(one('.legend'), one('.nsewdrag'))) problems.push('legend over plot area');
  // A timeline (horizontal bars) must fill its time axis: no axis running far past the run.
  const bars = gd._fullData.filter(t => t.type === 'bar' && t.orientation === 'h' && t.visible === true);
  if (bars.length) {
    let lo = Infinity, hi = -Infinity;
    for (const t of bars) t.x.forEach((w, i) => { const b = Array.isArray(t.base) || ArrayBuffer.isView(t.base) ? t.base[i] : (t.base || 0);
      lo = Math.min(lo, b); hi = Math.max(hi, b + w); });
    const [r0, r1] = gd._fullLayout.xaxis.range;
    if ((hi - lo) < 0.8 * (r1 - r0)) problems.push(`bars fill ${Math.round(100 * (hi - lo) / (r1 - r0))}% of the time axis`);
  }
  out.push({title: (gd.layout.title && (gd.layout.title.text || gd.layout.title)) + '', problems,
            fig: [fig.width, fig.height]});
}
return out;
