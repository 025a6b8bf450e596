// The live turn page: the turn's events arrive as server-sent events (its live stream, from
// just after what the page was rendered with); each is a timeline row, and the parts that a
// row may change (summary, approvals, transcript, ledger) are fetched again and swapped in.
// No reload, no build step.
(function () {
  "use strict";
  const root = document.getElementById("turn");
  if (!root) return;
  const turn = root.dataset.turn;
  const timeline = document.getElementById("timeline");
  const live = document.getElementById("live");
  let refreshing = null;
  let again = false;

  function when(ms) {
    return new Date(ms).toISOString().replace("T", " ").slice(0, 23);
  }

  function addRow(row) {
    const empty = timeline.querySelector(".empty-row");
    if (empty) empty.remove();
    const tr = document.createElement("tr");
    tr.className = row.tone;
    for (const [cls, value] of [["t", when(row.at_ms)], ["e", "e" + row.epoch], ["k", row.kind], ["", row.text]]) {
      const td = document.createElement("td");
      if (cls) td.className = cls;
      td.textContent = value;
      tr.appendChild(td);
    }
    timeline.appendChild(tr);
  }

  async function refresh() {
    if (refreshing) { again = true; return; }
    refreshing = fetch("/turns/" + encodeURIComponent(turn) + "/parts", {credentials: "same-origin"})
      .then((r) => (r.ok ? r.json() : null))
      .then((parts) => {
        if (!parts) return;
        for (const name of ["summary", "approvals", "transcript", "ledger"]) {
          const el = document.getElementById("part-" + name);
          if (el) el.innerHTML = parts[name];
        }
        const facts = document.querySelector("#part-summary .facts");
        if (facts) document.getElementById("status").textContent = facts.dataset.status;
      })
      .finally(() => {
        refreshing = null;
        if (again) { again = false; refresh(); }
      });
  }

  if (root.dataset.final === "1") return;
  const source = new EventSource(
    "/turns/" + encodeURIComponent(turn) + "/live?after=" + encodeURIComponent(root.dataset.after)
  );
  source.addEventListener("open", () => { live.hidden = false; });
  source.addEventListener("row", (e) => {
    const data = JSON.parse(e.data);
    addRow(data.row);
    if (data.phase) document.getElementById("phase").textContent = data.phase;
    if (data.refresh) refresh();
  });
  source.addEventListener("end", () => {
    source.close();
    live.hidden = true;
    refresh();
  });
  source.addEventListener("error", () => { live.hidden = true; });  // the browser reconnects
})();
