/* dsv4-parity report: case table sorting / filtering / details, pairwise coverage matrix, copy buttons.
   Everything is local to this file; window.dsv4Report is the hook the browser tests drive. */
(function () {
  "use strict";
  var DATA = JSON.parse(document.getElementById("case-data").textContent);
  var table = document.getElementById("cases-table");
  var tbody = table.tBodies[0];
  var headers = Array.prototype.slice.call(table.tHead.rows[0].cells);
  var rows = Array.prototype.slice.call(tbody.querySelectorAll("tr.case-row"));
  var NUMERIC = {};
  headers.forEach(function (th) { if (th.dataset.type === "num") NUMERIC[th.dataset.key] = true; });
  var ALIASES = {dtype: "dtype", layout: "layout", ratio: "ratio", scope: "scope", mode: "mode", outcome: "outcome",
                 worst: "worst", tensor: "worst", first: "first", decided: "decided_by", decided_by: "decided_by",
                 case: "case", id: "case", usage: "usage", nfr: "nfr", max_rel: "maxrel", maxrel: "maxrel",
                 drift: "drift", failed: "failed", tensors: "tensors", time: "time"};

  rows.forEach(function (row) {
    row._text = row.textContent.toLowerCase();
    row._cols = {};
    row._nums = {};
    Array.prototype.forEach.call(row.cells, function (td) {
      var key = td.dataset.col;
      if (!key) return;
      row._cols[key] = td.textContent.trim().toLowerCase();
      if (td.dataset.v !== undefined) row._nums[key] = td.dataset.v === "" ? NaN : parseFloat(td.dataset.v);
    });
  });

  // ---- sorting ----------------------------------------------------------------------------------------------
  var sortState = {key: null, dir: 1};
  function keyOf(row, key) {
    if (NUMERIC[key]) return row._nums[key];
    return row._cols[key] || "";
  }
  function sortBy(key, dir) {
    var numeric = !!NUMERIC[key];
    var order = rows.map(function (row, i) { return [keyOf(row, key), i, row]; });
    order.sort(function (a, b) {
      var x = a[0], y = b[0];
      if (numeric) {
        var xn = isNaN(x), yn = isNaN(y);
        if (xn || yn) return xn === yn ? a[1] - b[1] : (xn ? 1 : -1);   // missing values always last
        if (x !== y) return (x < y ? -1 : 1) * dir;
      } else if (x !== y) {
        return (x < y ? -1 : 1) * dir;
      }
      return a[1] - b[1];
    });
    var frag = document.createDocumentFragment();
    order.forEach(function (item) {
      frag.appendChild(item[2]);
      if (item[2]._detail) frag.appendChild(item[2]._detail);
    });
    tbody.appendChild(frag);
    rows = order.map(function (item) { return item[2]; });
    sortState = {key: key, dir: dir};
    headers.forEach(function (th) {
      if (th.dataset.key === key) th.setAttribute("aria-sort", dir > 0 ? "ascending" : "descending");
      else th.removeAttribute("aria-sort");
    });
  }
  headers.forEach(function (th) {
    th.addEventListener("click", function () {
      var key = th.dataset.key;
      // numbers first sort descending (worst first), text ascending; a second click flips
      var dir = sortState.key === key ? -sortState.dir : (NUMERIC[key] ? -1 : 1);
      sortBy(key, dir);
    });
  });

  // ---- filtering --------------------------------------------------------------------------------------------
  var input = document.getElementById("case-filter");
  var toggles = Array.prototype.slice.call(document.querySelectorAll("input.outcome-toggle"));
  var counter = document.getElementById("case-count");
  function parseToken(token) {
    var m = /^([a-z_]+)(>=|<=|>|<|=|:)(.*)$/.exec(token);
    if (m && ALIASES[m[1]] !== undefined && m[3] !== "") {
      var key = ALIASES[m[1]], op = m[2], value = m[3];
      if (op !== ":" && op !== "=" && NUMERIC[key]) {
        var limit = parseFloat(value);
        return function (row) {
          var v = row._nums[key];
          if (isNaN(v) || isNaN(limit)) return false;
          return op === ">" ? v > limit : op === "<" ? v < limit : op === ">=" ? v >= limit : v <= limit;
        };
      }
      if (op === "=") return function (row) { return (row._cols[key] || "") === value; };
      return function (row) { return (row._cols[key] || "").indexOf(value) >= 0; };
    }
    var negate = token.charAt(0) === "-" && token.length > 1;
    var text = negate ? token.slice(1) : token;
    return function (row) { return (row._text.indexOf(text) >= 0) !== negate; };
  }
  function applyFilter() {
    var tokens = input.value.trim().toLowerCase().split(/\s+/).filter(Boolean).map(parseToken);
    var allowed = {};
    toggles.forEach(function (t) { allowed[t.value] = t.checked; });
    var shown = 0;
    rows.forEach(function (row) {
      var ok = allowed[row._cols.outcome] !== false && tokens.every(function (f) { return f(row); });
      row.hidden = !ok;
      if (row._detail) row._detail.hidden = !ok;
      if (ok) shown += 1;
    });
    counter.textContent = shown + " of " + rows.length + " cases shown";
  }
  input.addEventListener("input", applyFilter);
  toggles.forEach(function (t) { t.addEventListener("change", applyFilter); });

  // ---- case details -----------------------------------------------------------------------------------------
  function el(tag, attrs, text) {
    var node = document.createElement(tag);
    if (attrs) Object.keys(attrs).forEach(function (k) { node.setAttribute(k, attrs[k]); });
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }
  function fmt(v) {
    if (v === null || v === undefined) return "–";
    if (typeof v === "string") return v;
    if (v === 0) return "0";
    var a = Math.abs(v);
    return (a >= 1e-3 && a < 1e4) ? String(Number(v.toPrecision(3))) : v.toExponential(2);
  }
  function copyButton(text) {
    var b = el("button", {"class": "copy", "type": "button"}, "copy");
    b.dataset.copy = text;
    return b;
  }
  function buildDetail(caseId, colspan) {
    var d = DATA.cases[caseId] || {};
    var tr = el("tr", {"class": "detail"});
    var cell = el("td", {colspan: String(colspan)});
    tr.appendChild(cell);
    var td = cell.appendChild(el("div", {"class": "detailbox"}));  // stays in view when the table scrolls sideways
    td.style.maxWidth = Math.max(400, table.parentNode.clientWidth - 40) + "px";
    if (d.m) td.appendChild(el("p", {"class": "msg"}, d.m));
    if (d.r) {
      var repro = el("div", {"class": "repro"});
      repro.appendChild(el("code", null, d.r));
      repro.appendChild(copyButton(d.r));
      td.appendChild(repro);
    }
    var t = el("table", {"class": "grid small tensors"});
    var head = el("tr");
    ["tensor", "class", "dtype", "shape", "verdict", "rule", "worst check", "usage"].concat(DATA.metrics)
      .forEach(function (name) { head.appendChild(el("th", null, name)); });
    t.appendChild(el("thead")).appendChild(head);
    var body = el("tbody");
    (d.t || []).forEach(function (x) {
      var r = el("tr");
      [x[0], x[1], x[2], x[3], x[4], x[5], x[6], fmt(x[7])].forEach(function (v, i) {
        var c = el("td", i === 7 ? {"class": "n"} : null, v === null ? "" : v);
        if (i === 4 && v === "fail") c.className = "mfail";
        if (i === 7 && x[7] !== null && (x[7] === "inf" || x[7] > 1)) c.className = "n mfail";
        r.appendChild(c);
      });
      x[9].forEach(function (v, i) {
        var failed = x[8].indexOf(DATA.metrics[i]) >= 0;
        r.appendChild(el("td", {"class": failed ? "n mfail" : "n"}, fmt(v)));
      });
      body.appendChild(r);
    });
    t.appendChild(body);
    var scroller = td.appendChild(el("div", {"class": "tscroll"}));
    scroller.appendChild(d.t && d.t.length ? t : el("p", {"class": "dim"}, "No tensor was compared."));
    var grid = td.appendChild(el("div", {"class": "dgrid"}));
    var left = grid.appendChild(el("div"));
    left.appendChild(el("h4", null, "case JSON"));
    left.appendChild(el("pre", {"class": "json"}, JSON.stringify(d.c, null, 2)));
    var right = grid.appendChild(el("div"));
    right.appendChild(el("h4", null, "first failure · plan · top-k regimes · features"));
    var extra = {first_failure: d.ff, plan: d.p, topk: d.k, features: d.f};
    right.appendChild(el("pre", {"class": "json"}, JSON.stringify(extra, null, 1)));
    return tr;
  }
  function toggleDetail(row, open) {
    var isOpen = !!row._detail;
    if (open === undefined) open = !isOpen;
    if (open && !isOpen) {
      row._detail = buildDetail(row.dataset.case, headers.length);
      row.parentNode.insertBefore(row._detail, row.nextSibling);
      row.classList.add("selected");
      row.querySelector("button.expand").textContent = "▾";
    } else if (!open && isOpen) {
      row._detail.remove();
      row._detail = null;
      row.classList.remove("selected");
      row.querySelector("button.expand").textContent = "▸";
    }
  }
  tbody.addEventListener("click", function (event) {
    var button = event.target.closest("button.expand");
    if (button) toggleDetail(button.closest("tr"));
  });
  // links to a case (drift tables, new failures) open its details and clear filters that would hide it
  document.addEventListener("click", function (event) {
    var link = event.target.closest("a.caselink");
    if (!link) return;
    var row = document.getElementById("case-" + link.dataset.case);
    if (!row) return;
    event.preventDefault();
    input.value = "";
    toggles.forEach(function (t) { t.checked = true; });
    applyFilter();
    toggleDetail(row, true);
    row.scrollIntoView({block: "center"});
  });

  // ---- copy buttons -----------------------------------------------------------------------------------------
  document.addEventListener("click", function (event) {
    var button = event.target.closest("button.copy");
    if (!button) return;
    var text = button.dataset.copy;
    function done(ok) { button.textContent = ok ? "copied" : "select + ctrl-c"; }
    function fallback() {
      var area = el("textarea");
      area.value = text;
      document.body.appendChild(area);
      area.select();
      var ok = false;
      try { ok = document.execCommand("copy"); } catch (e) { ok = false; }
      area.remove();
      done(ok);
    }
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(function () { done(true); }, fallback);
    } else {
      fallback();
    }
  });

  // ---- pairwise coverage matrix -----------------------------------------------------------------------------
  var rowSel = document.getElementById("cov-row"), colSel = document.getElementById("cov-col");
  var matrix = document.getElementById("cov-matrix");
  function label(v) {
    if (v === true) return "true";
    if (v === false) return "false";
    if (v === null || v === undefined) return "—";
    return typeof v === "object" ? JSON.stringify(v) : String(v);
  }
  function buildMatrix() {
    var rk = rowSel.value, ck = colSel.value, counts = {}, fails = {}, rvals = {}, cvals = {};
    Object.keys(DATA.cases).forEach(function (id) {
      var d = DATA.cases[id], f = d.f || {};
      var r = label(f[rk]), c = label(f[ck]), key = r + "\u0000" + c;
      rvals[r] = true; cvals[c] = true;
      counts[key] = (counts[key] || 0) + 1;
      var row = document.getElementById("case-" + id);
      var outcome = row ? row._cols.outcome : "";
      if (outcome === "fail" || outcome === "error") fails[key] = (fails[key] || 0) + 1;
    });
    function sorted(obj) {
      return Object.keys(obj).sort(function (a, b) {
        var x = parseFloat(a), y = parseFloat(b);
        return (!isNaN(x) && !isNaN(y)) ? x - y : (a < b ? -1 : a > b ? 1 : 0);
      });
    }
    var rs = sorted(rvals), cs = sorted(cvals);
    var t = el("table", {"class": "grid small"});
    var head = el("tr");
    head.appendChild(el("th", null, rk + " \\ " + ck));
    cs.forEach(function (c) { head.appendChild(el("th", null, c)); });
    t.appendChild(el("thead")).appendChild(head);
    var body = el("tbody");
    rs.forEach(function (r) {
      var tr = el("tr");
      tr.appendChild(el("th", null, r));
      cs.forEach(function (c) {
        var key = r + "\u0000" + c, n = counts[key] || 0, f = fails[key] || 0;
        var cell = el("td", {"class": n ? (f ? "hasfail" : "") : "empty"}, n ? (f ? n + " (" + f + " fail)" : n) : "");
        tr.appendChild(cell);
      });
      body.appendChild(tr);
    });
    t.appendChild(body);
    matrix.textContent = "";
    matrix.appendChild(t);
  }
  if (rowSel && colSel) {
    var keys = {};
    Object.keys(DATA.cases).forEach(function (id) { Object.keys(DATA.cases[id].f || {}).forEach(function (k) { keys[k] = true; }); });
    var names = Object.keys(keys).sort();
    names.forEach(function (k) { rowSel.appendChild(el("option", {value: k}, k)); colSel.appendChild(el("option", {value: k}, k)); });
    if (names.length) {
      rowSel.value = names.indexOf("layout") >= 0 ? "layout" : names[0];
      colSel.value = names.indexOf("ratio") >= 0 ? "ratio" : names[Math.min(1, names.length - 1)];
      rowSel.addEventListener("change", buildMatrix);
      colSel.addEventListener("change", buildMatrix);
      buildMatrix();
    }
  }

  applyFilter();
  window.dsv4Report = {
    sortBy: sortBy,
    setFilter: function (text) { input.value = text; applyFilter(); },
    visibleCaseIds: function () { return rows.filter(function (r) { return !r.hidden; }).map(function (r) { return r.dataset.case; }); },
    openCase: function (id) { var r = document.getElementById("case-" + id); if (r) toggleDetail(r, true); return !!r; }
  };
})();
