/*
 * gpuslice console: a read-only page over the inventory's console API.
 *
 * Plain ES2020, no framework and no build step. Everything that comes from the
 * API (pod names are chosen by tenants) reaches the document through
 * textContent or setAttribute, never through HTML parsing. Live data comes from
 * /api/v1/stream read with fetch() so that a bearer token can be sent, parsed
 * as server-sent events here, and reconnected with backoff when it drops.
 */
'use strict';

(() => {
  const TOKEN_KEY = 'gpuslice.console.token';
  const MAX_SSE_BUFFER = 64 * 1024 * 1024; // one event bigger than this is not a snapshot
  const STALL_MS = 45000; // the server sends a keepalive every 15 s
  const MAX_AUDIT_ROWS = 5000;
  const EVENT_TYPES = [
    'pod.admitted', 'pod.denied', 'alloc.reserved', 'alloc.bound',
    'alloc.allocated', 'alloc.released', 'alloc.failed', 'alloc.preempted',
    'enforce.memory-kill', 'enforce.throttle', 'enforce.compute-kill', 'enforce.ungranted-kill',
  ];
  const STATES = ['reserved', 'bound', 'allocated', 'released', 'denied', 'failed'];
  const FRAGMENTED = 0.25; // from this fraction of the free share in fragments, say so loudly

  const viewEl = document.getElementById('view');
  const mainEl = document.getElementById('main');
  const alertsEl = document.getElementById('alerts');
  const liveEl = document.getElementById('live');
  const viewerEl = document.getElementById('viewer-name');

  // ------------------------------------------------------------ formatting

  /** Trims a fixed-point string's trailing zeros: "4.0" -> "4". */
  function trimZeros(text) {
    return text.includes('.') ? text.replace(/\.?0+$/, '') : text;
  }

  /** A size in MiB as MiB, GiB or TiB with at most one decimal. */
  function fmtMiB(mib) {
    if (mib === null || mib === undefined || !Number.isFinite(mib)) return '—';
    const abs = Math.abs(mib);
    if (abs >= 1024 * 1024) return `${trimZeros((mib / 1048576).toFixed(abs >= 100 * 1048576 ? 0 : 1))} TiB`;
    if (abs >= 1024) return `${trimZeros((mib / 1024).toFixed(abs >= 100 * 1024 ? 0 : 1))} GiB`;
    if (abs > 0 && abs < 1) return `${trimZeros(mib.toFixed(2))} MiB`;
    return `${Math.round(mib)} MiB`;
  }

  /**
   * Memory a pod asked for (or was granted from what it asked), in the MiB it
   * is asked in: 4000 MiB stays "4000 MiB", never "3.9 GiB". A grant that is
   * not a whole MiB (a limit in bytes) is shown as a size.
   */
  function fmtAskedMiB(mib) {
    if (mib === null || mib === undefined || !Number.isFinite(mib)) return '—';
    return Number.isInteger(mib) ? `${mib} MiB` : fmtMiB(mib);
  }

  function fmtBytes(bytes) {
    if (bytes === null || bytes === undefined || !Number.isFinite(bytes)) return '—';
    if (Math.abs(bytes) < 1024) return `${bytes} B`;
    if (Math.abs(bytes) < 1048576) return `${trimZeros((bytes / 1024).toFixed(1))} KiB`;
    return fmtMiB(bytes / 1048576);
  }

  /** A number that is already a percentage (0..100). */
  function fmtPercent(p) {
    if (p === null || p === undefined || !Number.isFinite(p)) return '—';
    if (p > 0 && p < 1) return '<1%';
    return `${trimZeros(p.toFixed(p >= 10 ? 0 : 1))}%`;
  }

  /** A fraction (0..1) as a percentage. */
  function fmtFraction(f) {
    if (f === null || f === undefined || !Number.isFinite(f)) return '—';
    return fmtPercent(f * 100);
  }

  function fmtCount(n) {
    if (n === null || n === undefined || !Number.isFinite(n)) return '—';
    return Math.round(n).toLocaleString('en-US');
  }

  /** A duration in nanoseconds, in the largest unit that keeps it readable. */
  function fmtDurationNs(ns) {
    if (ns === null || ns === undefined || !Number.isFinite(ns)) return '—';
    if (ns <= 0) return '0 s';
    if (ns < 1e3) return `${Math.round(ns)} ns`;
    if (ns < 1e6) return `${trimZeros((ns / 1e3).toFixed(ns < 1e4 ? 1 : 0))} µs`;
    if (ns < 1e9) return `${trimZeros((ns / 1e6).toFixed(ns < 1e7 ? 1 : 0))} ms`;
    return fmtSeconds(ns / 1e9);
  }

  function fmtSeconds(s) {
    if (s < 60) return `${trimZeros(s.toFixed(s < 10 ? 1 : 0))} s`;
    if (s < 3600) {
      const m = Math.floor(s / 60);
      const rest = Math.floor(s % 60);
      return rest ? `${m} min ${rest} s` : `${m} min`;
    }
    if (s < 86400) {
      const hrs = Math.floor(s / 3600);
      const m = Math.floor((s % 3600) / 60);
      return m ? `${hrs} h ${m} min` : `${hrs} h`;
    }
    const d = Math.floor(s / 86400);
    const hrs = Math.floor((s % 86400) / 3600);
    return hrs ? `${d} d ${hrs} h` : `${d} d`;
  }

  function parseTime(iso) {
    if (typeof iso !== 'string') return null;
    const t = Date.parse(iso);
    return Number.isFinite(t) ? new Date(t) : null;
  }

  const timeFormat = new Intl.DateTimeFormat(undefined, {
    hour: '2-digit', minute: '2-digit', second: '2-digit', hourCycle: 'h23',
  });
  const dateTimeFormat = new Intl.DateTimeFormat(undefined, {
    month: 'short', day: 'numeric', hour: '2-digit', minute: '2-digit', second: '2-digit',
    hourCycle: 'h23',
  });

  function fmtClock(date) {
    const now = new Date();
    const sameDay = date.toDateString() === now.toDateString();
    return (sameDay ? timeFormat : dateTimeFormat).format(date);
  }

  function fmtAgo(date) {
    const s = (Date.now() - date.getTime()) / 1000;
    if (s < 5) return 'just now';
    if (s < 0) return 'in the future';
    return `${fmtSeconds(Math.floor(s))} ago`;
  }

  /** A <time> element: the clock time shown, the full timestamp as its title. */
  function timeEl(iso, { ago = false } = {}) {
    const date = parseTime(iso);
    if (!date) return h('span', { class: 'muted' }, '—');
    return h('time', { datetime: date.toISOString(), title: date.toISOString() },
      ago ? fmtAgo(date) : fmtClock(date));
  }

  // ------------------------------------------------------------ DOM helpers

  /**
   * Builds an element. Attributes are set with setAttribute (never parsed as
   * HTML); `text` sets textContent; `testid` sets data-testid; functions whose
   * name starts with "on" become event listeners. Children are nodes or strings
   * (strings become text nodes); null/false children are skipped.
   */
  function h(tag, attrs, ...children) {
    const el = document.createElement(tag);
    if (attrs) {
      for (const [key, value] of Object.entries(attrs)) {
        if (value === null || value === undefined || value === false) continue;
        if (key === 'text') el.textContent = String(value);
        else if (key === 'testid') el.setAttribute('data-testid', String(value));
        else if (key.startsWith('on') && typeof value === 'function') el.addEventListener(key.slice(2), value);
        else if (value === true) el.setAttribute(key, '');
        else el.setAttribute(key, String(value));
      }
    }
    append(el, children);
    return el;
  }

  function append(el, children) {
    for (const child of children) {
      if (child === null || child === undefined || child === false) continue;
      if (Array.isArray(child)) append(el, child);
      else if (child instanceof Node) el.appendChild(child);
      else el.appendChild(document.createTextNode(String(child)));
    }
  }

  /** replaceChildren that, like h(), skips null children and flattens arrays. */
  function setChildren(el, ...children) {
    el.replaceChildren();
    append(el, children);
  }

  function badge(text, kind, title) {
    return h('span', { class: `badge badge-${kind}`, title }, text);
  }

  function clamp01(x) {
    return Number.isFinite(x) ? Math.min(1, Math.max(0, x)) : 0;
  }

  /** Width set through the CSSOM: allowed by the page's CSP, unlike style="". */
  function setWidth(el, fraction) {
    el.style.width = `${(clamp01(fraction) * 100).toFixed(2)}%`;
  }

  function setLeft(el, fraction) {
    el.style.left = `${(clamp01(fraction) * 100).toFixed(2)}%`;
  }

  function podHref(namespace, name) {
    return `#/pods/${encodeURIComponent(namespace)}/${encodeURIComponent(name)}`;
  }

  function podLink(namespace, name, extra) {
    return h('a', { href: podHref(namespace, name), class: 'pod-link', testid: `pod-link-${namespace}-${name}` },
      h('span', { class: 'ns' }, `${namespace}/`), h('span', { class: 'name' }, name), extra || null);
  }

  function num(x) {
    return typeof x === 'number' && Number.isFinite(x) ? x : null;
  }

  // ------------------------------------------------------------ alerts

  function showAlert(message) {
    alertsEl.replaceChildren(h('div', { class: 'alert', testid: 'alert' },
      h('span', { class: 'alert-text' }, message),
      h('button', { type: 'button', class: 'link-button', onclick: () => alertsEl.replaceChildren() }, 'Dismiss')));
  }

  function clearAlert() {
    alertsEl.replaceChildren();
  }

  // ------------------------------------------------------------ data that is not live

  const MAX_PROBLEM_TEXT = 500;
  const PROBLEM_POLL_MS = 5000; // how often a following audit view asks whether its feed is whole

  /**
   * The warning that what a view shows is not live: the server's `problem`
   * (the ledger or the audit stream cannot be read now, and since when). The
   * slot is a live region kept in the view from the start, so that a screen
   * reader announces the banner when it appears; the banner is there only
   * while the server says there is a problem. `marked` are the elements
   * showing the data, marked stale (data-stale) meanwhile.
   */
  function problemBanner(what, marked) {
    const slot = h('div', { class: 'problem-slot', role: 'alert' });
    let shown = null;
    for (const el of marked) el.setAttribute('data-stale', 'false');
    function set(problem) {
      const text = typeof problem === 'string' && problem.trim()
        ? problem.trim().slice(0, MAX_PROBLEM_TEXT) : null;
      if (text === shown) return; // unchanged: not announced again
      shown = text;
      for (const el of marked) el.setAttribute('data-stale', text === null ? 'false' : 'true');
      if (text === null) {
        slot.replaceChildren();
        return;
      }
      slot.replaceChildren(h('div', { class: 'problem-banner', testid: 'data-problem' },
        h('strong', { class: 'problem-title' }, `${what} is not live: `),
        h('span', { class: 'problem-text' }, text.endsWith('.') ? text : `${text}.`),
        h('span', { class: 'problem-hint' }, ' The last data read is shown, marked stale; this clears by itself when the server reads again.')));
    }
    return { el: slot, set, stale: () => shown !== null };
  }

  // ------------------------------------------------------------ authentication and API

  let token = sessionStorage.getItem(TOKEN_KEY);
  let tokenPrompt = null;

  class ApiError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  function authHeaders(accept) {
    const headers = { Accept: accept };
    if (token) headers.Authorization = `Bearer ${token}`;
    return headers;
  }

  async function errorText(res) {
    let message = `HTTP ${res.status}`;
    try {
      const body = await res.json();
      if (body && typeof body.error === 'string' && body.error) message = body.error;
    } catch (_) {
      // not JSON: the status says enough
    }
    return message.length > 500 ? `${message.slice(0, 500)}…` : message;
  }

  /**
   * Asks for a bearer token in a modal dialog; every caller that got a 401
   * while the dialog is open waits for the same answer.
   */
  function askToken(reason) {
    if (tokenPrompt) return tokenPrompt;
    const dialog = document.getElementById('token-dialog');
    const form = document.getElementById('token-form');
    const input = document.getElementById('token-input');
    const error = document.getElementById('token-error');
    error.textContent = token ? `The token was refused: ${reason}` : '';
    input.value = '';
    tokenPrompt = new Promise((resolve) => {
      const onSubmit = (event) => {
        event.preventDefault();
        const value = input.value.trim();
        if (!value) {
          error.textContent = 'Enter a token.';
          input.focus();
          return;
        }
        if (value.length > 16384 || /[^\x21-\x7e]/.test(value)) {
          error.textContent = 'That is not a bearer token: it must be printable ASCII without spaces, at most 16 KiB.';
          input.focus();
          return;
        }
        token = value;
        sessionStorage.setItem(TOKEN_KEY, value);
        form.removeEventListener('submit', onSubmit);
        dialog.removeEventListener('cancel', onCancel);
        dialog.close();
        tokenPrompt = null;
        resolve(value);
      };
      // Escape would leave the page with nothing to show: keep the dialog open.
      const onCancel = (event) => event.preventDefault();
      form.addEventListener('submit', onSubmit);
      dialog.addEventListener('cancel', onCancel);
    });
    setLive('offline', 'Waiting for a token');
    if (!dialog.open) dialog.showModal();
    input.focus();
    return tokenPrompt;
  }

  /** GET a JSON document; a 401 asks for a token and tries again. */
  async function api(path, { signal } = {}) {
    for (;;) {
      const res = await fetch(path, { headers: authHeaders('application/json'), signal, cache: 'no-store', credentials: 'same-origin' });
      if (res.status === 401) {
        await askToken(await errorText(res));
        continue;
      }
      if (!res.ok) throw new ApiError(res.status, await errorText(res));
      return res.json();
    }
  }

  // ------------------------------------------------------------ live indicator

  const LIVE_TEXT = {
    connecting: 'Connecting…',
    live: 'Live',
    reconnecting: 'Reconnecting…',
    offline: 'Offline',
    paused: 'Not following',
  };

  function setLive(state, detail) {
    liveEl.setAttribute('data-state', state);
    const text = liveEl.querySelector('.live-text');
    const wanted = detail ? `${LIVE_TEXT[state]} ${detail}` : LIVE_TEXT[state];
    if (text.textContent !== wanted) text.textContent = wanted;
  }

  // ------------------------------------------------------------ server-sent events over fetch

  /**
   * Reads a text/event-stream body and calls onMessage(eventName, data) per
   * event; comments (keepalives) call onActivity only. Returns when the body ends.
   */
  async function readSse(body, onMessage, onActivity) {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let buffer = '';
    let eventName = '';
    let data = [];
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) return;
        onActivity();
        buffer += decoder.decode(value, { stream: true });
        if (buffer.length > MAX_SSE_BUFFER) throw new Error('an event from the server is too large');
        let start = 0;
        for (;;) {
          let end = -1;
          let next = -1;
          for (let i = start; i < buffer.length; i++) {
            const c = buffer.charCodeAt(i);
            if (c === 10) { end = i; next = i + 1; break; }
            if (c === 13) {
              if (i + 1 === buffer.length) break; // a CR at the end may be half of CRLF
              end = i;
              next = buffer.charCodeAt(i + 1) === 10 ? i + 2 : i + 1;
              break;
            }
          }
          if (end < 0) break;
          const line = buffer.slice(start, end);
          start = next;
          if (line === '') {
            if (data.length) onMessage(eventName || 'message', data.join('\n'));
            eventName = '';
            data = [];
            continue;
          }
          if (line.startsWith(':')) continue;
          const colon = line.indexOf(':');
          const field = colon < 0 ? line : line.slice(0, colon);
          let value = colon < 0 ? '' : line.slice(colon + 1);
          if (value.startsWith(' ')) value = value.slice(1);
          if (field === 'event') eventName = value;
          else if (field === 'data') data.push(value);
        }
        buffer = buffer.slice(start);
      }
    } finally {
      reader.releaseLock();
    }
  }

  /**
   * Keeps a stream open: reconnects with exponential backoff (1 s doubling to
   * 30 s, with jitter) and shows the state in the header's live indicator;
   * a 400, 403 or 404 answer ends it (offline).
   * onEvent(name, parsedData); onOpen() after every (re)connection. Returns a
   * function that closes the stream for good.
   */
  function openStream(query, onEvent, { onOpen } = {}) {
    let stopped = false;
    let attempt = 0;
    let retryTimer = null;
    let countdown = null;
    let conn = null;

    async function connect() {
      if (stopped) return;
      setLive(attempt ? 'reconnecting' : 'connecting');
      conn = new AbortController();
      const current = conn;
      let watchdog = null;
      const activity = () => {
        clearTimeout(watchdog);
        watchdog = setTimeout(() => current.abort(), STALL_MS);
      };
      try {
        activity();
        const res = await fetch(`api/v1/stream?${query}`, {
          headers: authHeaders('text/event-stream'), signal: current.signal, cache: 'no-store', credentials: 'same-origin',
        });
        if (res.status === 401) {
          clearTimeout(watchdog);
          await askToken(await errorText(res));
          connect();
          return;
        }
        if (!res.ok) throw new ApiError(res.status, await errorText(res));
        if (!res.body) throw new Error('this browser cannot read a streamed response');
        setLive('live');
        if (onOpen) onOpen();
        await readSse(res.body, (name, raw) => {
          attempt = 0;
          let parsed;
          try {
            parsed = JSON.parse(raw);
          } catch (_) {
            return; // not JSON: not something the page can show
          }
          onEvent(name, parsed);
        }, activity);
        throw new Error('the server closed the stream');
      } catch (err) {
        clearTimeout(watchdog);
        if (stopped) return;
        // A refusal that asking again will not change: say so and stop. (A 404
        // is the pod view's of a namespace the viewer may not see; the view
        // already says the pod is unknown.)
        if (err instanceof ApiError && [400, 403, 404].includes(err.status)) {
          setLive('offline');
          if (err.status !== 404) showAlert(err.message);
          return;
        }
        attempt += 1;
        const delay = Math.min(30000, 1000 * 2 ** Math.min(attempt - 1, 5)) * (0.8 + Math.random() * 0.4);
        let left = Math.ceil(delay / 1000);
        setLive('reconnecting', `in ${left} s`);
        clearInterval(countdown);
        countdown = setInterval(() => {
          left -= 1;
          if (left > 0) setLive('reconnecting', `in ${left} s`);
        }, 1000);
        retryTimer = setTimeout(() => {
          clearInterval(countdown);
          connect();
        }, delay);
      } finally {
        clearTimeout(watchdog);
      }
    }

    connect();
    return () => {
      stopped = true;
      clearTimeout(retryTimer);
      clearInterval(countdown);
      if (conn) conn.abort();
    };
  }

  // ------------------------------------------------------------ bars

  /**
   * A horizontal bar with role=progressbar. `parts` are drawn from the left,
   * each {cls, fraction}; `marker` an optional {cls, fraction, label} line.
   */
  function bar({ label, testid, now, max, valueText, parts, marker }) {
    const el = h('div', {
      class: 'bar', role: 'progressbar', 'aria-label': label, testid,
      'aria-valuemin': '0',
      'aria-valuemax': max === null ? null : String(max),
      'aria-valuenow': now === null ? null : String(now),
      'aria-valuetext': valueText,
    });
    for (const part of parts) {
      const fill = h('div', { class: `bar-fill ${part.cls}` });
      setWidth(fill, part.fraction);
      el.appendChild(fill);
    }
    if (marker) {
      const mark = h('div', { class: `bar-mark ${marker.cls}`, title: marker.label });
      setLeft(mark, marker.fraction);
      el.appendChild(mark);
    }
    return el;
  }

  // ------------------------------------------------------------ history charts

  const SVG_NS = 'http://www.w3.org/2000/svg';
  const CHART_W = 600;
  const CHART_H = 160;
  const HISTORY_MIN_MS = 5000; // a page asks for its history at most this often
  const HISTORY_EVERY_MS = 30000; // and at least this often (one step): the hour moves on

  function svg(tag, attrs) {
    const el = document.createElementNS(SVG_NS, tag);
    for (const [key, value] of Object.entries(attrs || {})) el.setAttribute(key, String(value));
    return el;
  }

  /** The values of one field of a history document, by field name: [[ms, value|null], ...]. */
  function historyValues(doc, value) {
    const fields = Array.isArray(doc.fields) ? doc.fields : [];
    const at = (p, name) => {
      const i = fields.indexOf(name);
      return i < 0 ? null : num(p[i]);
    };
    const points = Array.isArray(doc.points) ? doc.points : [];
    return points.filter(Array.isArray).map((p) => [num(p[0]), value((name) => at(p, name))]);
  }

  function summarise(values, fmt) {
    const known = values.map(([, v]) => v).filter((v) => v !== null);
    if (!known.length) return 'no data';
    return `now ${fmt(known[known.length - 1])}, lowest ${fmt(Math.min(...known))}, highest ${fmt(Math.max(...known))}`;
  }

  /**
   * A line chart of the last hour as inline SVG: role=img with a label that
   * sums each series up, a legend, and a visually hidden table of every value.
   * `series`: [{ name, field, cls, value(at) -> number|null, fmt }]; `max`: the
   * top of the scale at least (it grows to the highest value).
   */
  function historyChart({ id, title, doc, series, max }) {
    const span = (num(doc.span_s) || 3600) * 1000;
    const lines = series.map((s) => ({ ...s, values: historyValues(doc, s.value) }));
    const end = Math.max(Date.now(), ...lines.flatMap((l) => l.values.map(([t]) => t || 0)));
    const start = end - span;
    let top = max || 0;
    for (const l of lines) for (const [, v] of l.values) if (v !== null && v > top) top = v;
    if (!(top > 0)) top = 1;
    top *= 1.05; // the highest line stays inside the frame
    const x = (t) => ((t - start) / span) * CHART_W;
    const y = (v) => CHART_H - (v / top) * CHART_H;
    const label = `${title}, last hour: ${lines.map((l) => `${l.name} ${summarise(l.values, l.fmt)}`).join('; ')}`;
    const chart = svg('svg', { class: 'chart', viewBox: `0 0 ${CHART_W} ${CHART_H}`, preserveAspectRatio: 'none', role: 'img', 'aria-label': label, 'data-testid': `chart-${id}` });
    for (const frac of [0.25, 0.5, 0.75]) {
      chart.appendChild(svg('line', { class: 'chart-grid', x1: 0, x2: CHART_W, y1: CHART_H * frac, y2: CHART_H * frac, 'vector-effect': 'non-scaling-stroke' }));
    }
    for (const l of lines) {
      let run = [];
      const flush = () => {
        if (run.length === 1) run.push([run[0][0] + 1, run[0][1]]); // one point still shows
        if (run.length) chart.appendChild(svg('polyline', { class: `chart-line ${l.cls}`, points: run.map(([a, b]) => `${a.toFixed(1)},${b.toFixed(1)}`).join(' '), 'vector-effect': 'non-scaling-stroke' }));
        run = [];
      };
      for (const [t, v] of l.values) {
        if (v === null || t === null) flush();
        else run.push([x(t), y(v)]);
      }
      flush();
    }
    const legend = h('ul', { class: 'chart-legend', 'aria-hidden': 'true' }, lines.map((l) => {
      const known = l.values.filter(([, v]) => v !== null);
      const now = known.length ? known[known.length - 1][1] : null;
      return h('li', null, h('span', { class: `chart-key ${l.cls}` }), `${l.name} ${now === null ? '—' : l.fmt(now)}`);
    }));
    const times = lines.length ? lines[0].values.map(([t]) => t) : [];
    const table = h('table', { class: 'sr-only', testid: `history-${id}` },
      h('caption', null, `${title}, last hour`),
      h('thead', null, h('tr', null, h('th', { scope: 'col' }, 'Time'), lines.map((l) => h('th', { scope: 'col' }, l.name)))),
      h('tbody', null, times.map((t, i) => h('tr', null,
        h('th', { scope: 'row' }, t === null ? '—' : fmtClock(new Date(t))),
        lines.map((l) => {
          const v = l.values[i][1];
          return h('td', { 'data-field': l.field, 'data-value': v === null ? null : String(v) }, v === null ? '—' : l.fmt(v));
        })))));
    return h('figure', { class: 'history-chart', testid: `history-chart-${id}` },
      h('figcaption', null, h('span', { class: 'metric-name' }, title),
        lines.length ? h('span', { class: 'muted chart-scale', 'aria-hidden': 'true' }, ` · top ${lines[0].fmt(top / 1.05)}`) : null),
      chart, legend, table,
      times.length ? null : h('p', { class: 'muted' }, 'Nothing recorded yet.'));
  }

  /**
   * A section of charts over `api/v1/history?<query>`, asked for again by
   * `refresh()` (at most every HISTORY_MIN_MS, and every HISTORY_EVERY_MS on
   * its own). `charts(doc)` gives the charts.
   */
  function historySection(ctx, { id, query, charts }) {
    const titleId = `history-title-${id}`;
    const body = h('div', { class: 'history-charts' }, h('p', { class: 'muted' }, 'Loading the last hour…'));
    const el = h('section', { class: 'history', testid: `history-${id}-section`, 'aria-labelledby': titleId },
      h('h2', { id: titleId }, 'Last hour'), body);
    let last = 0;
    let timer = null;
    let inFlight = false;
    async function load() {
      if (inFlight || ctx.signal.aborted) return;
      inFlight = true;
      last = Date.now();
      try {
        const doc = await api(`api/v1/history${query ? `?${query}` : ''}`, { signal: ctx.signal });
        setChildren(body, charts(doc));
      } catch (err) {
        if (err instanceof ApiError && err.status === 404) setChildren(body, h('p', { class: 'muted' }, 'Nothing recorded yet.'));
        else if (!(err && err.name === 'AbortError')) setChildren(body, h('p', { class: 'muted' }, `The last hour cannot be shown: ${err.message || err}`));
      } finally {
        inFlight = false;
      }
    }
    function refresh() {
      if (timer !== null) return;
      timer = setTimeout(() => {
        timer = null;
        load();
      }, Math.max(0, last + HISTORY_MIN_MS - Date.now()));
    }
    const every = setInterval(refresh, HISTORY_EVERY_MS);
    ctx.onStop(() => {
      clearInterval(every);
      if (timer !== null) clearTimeout(timer);
    });
    load();
    return { el, refresh };
  }

  /** A card's or a pod's charts: memory (allocated, measured, limit) and compute. */
  function usageCharts(id, doc) {
    return [
      historyChart({ id: `${id}-memory`, title: 'Memory', doc, series: [
        { name: 'allocated', field: 'allocated_mib', cls: 'alloc', value: (at) => at('allocated_mib'), fmt: fmtMiB },
        { name: 'measured', field: 'measured_mib', cls: 'measured', value: (at) => at('measured_mib'), fmt: fmtMiB },
        { name: 'limit', field: 'limit_mib', cls: 'limit', value: (at) => at('limit_mib'), fmt: fmtMiB },
      ] }),
      historyChart({ id: `${id}-compute`, title: 'Compute', doc, max: 100, series: [
        { name: 'cores allocated', field: 'cores', cls: 'alloc', value: (at) => at('cores'), fmt: fmtCount },
        { name: 'SM busy', field: 'sm_percent', cls: 'measured', value: (at) => at('sm_percent'), fmt: fmtPercent },
      ] }),
    ];
  }

  function share(part, whole) {
    return part === null || !whole ? null : (part / whole) * 100;
  }

  /** The cluster's charts: how much is allocated, and how fragmented the free share is. */
  function clusterCharts(doc) {
    return [
      historyChart({ id: 'cluster-allocation', title: 'Allocated', doc, max: 100, series: [
        { name: 'memory', field: 'memory', cls: 'alloc', value: (at) => share(at('used_memory_mib'), at('memory_mib')), fmt: fmtPercent },
        { name: 'cores', field: 'cores', cls: 'measured', value: (at) => share(at('used_cores'), at('cores')), fmt: fmtPercent },
      ] }),
      historyChart({ id: 'cluster-fragmentation', title: 'Fragmentation', doc, max: 100, series: [
        { name: 'fragmentation', field: 'fragmentation', cls: 'stranded', value: (at) => (at('fragmentation') === null ? null : at('fragmentation') * 100), fmt: fmtPercent },
      ] }),
    ];
  }

  // ------------------------------------------------------------ cluster view

  /** How full a card is, for its colour and its text badge. */
  function cardState(card) {
    if (!card.healthy) return { key: 'unhealthy', label: 'Unhealthy' };
    const used = card.used || {};
    const mem = num(card.memory_mib) ? (num(used.memory_mib) || 0) / card.memory_mib : 0;
    const cores = num(card.cores) ? (num(used.cores) || 0) / card.cores : 0;
    const slots = num(card.slots) ? (num(used.slots) || 0) / card.slots : 0;
    const highest = Math.max(mem, cores, slots);
    let state;
    if (highest <= 0) state = { key: 'free', label: 'Free' };
    else if (highest >= 0.999) {
      state = Math.min(mem, cores) < 0.5
        ? { key: 'stranded', label: 'Stranded' }
        : { key: 'full', label: 'Full' };
    } else state = { key: 'partial', label: 'In use' };
    state.fraction = highest;
    if (card.cordoned) state.cordoned = true;
    return state;
  }

  const STATE_HELP = {
    free: 'Nothing allocated',
    partial: 'Partly allocated: room for more pods',
    full: 'Memory, cores or slots fully allocated',
    stranded: 'One resource used up while at least half of another is still free: the rest is stranded',
    unhealthy: 'The device plugin reports this card unhealthy',
  };

  function legend() {
    const items = ['free', 'partial', 'full', 'stranded', 'unhealthy'].map((key) => h('li', { class: `legend-item state-${key}` },
      h('span', { class: 'swatch', 'aria-hidden': 'true' }),
      h('span', { class: 'legend-name' }, { free: 'Free', partial: 'In use', full: 'Full', stranded: 'Stranded', unhealthy: 'Unhealthy' }[key]),
      h('span', { class: 'legend-help' }, STATE_HELP[key])));
    const bars = h('li', { class: 'legend-item legend-bars' },
      h('span', { class: 'swatch-bar', 'aria-hidden': 'true' },
        h('span', { class: 'bar-fill alloc' }), h('span', { class: 'bar-fill measured' })),
      h('span', { class: 'legend-name' }, 'Bars'),
      h('span', { class: 'legend-help' }, 'light: allocated, dark: measured in use'));
    return h('section', { class: 'legend', 'aria-label': 'Legend' }, h('ul', null, items, bars));
  }

  /** Each card's allocated share of its own cores, averaged over the cards. */
  function cardsCoreFraction(snap) {
    const nodes = Array.isArray(snap.nodes) ? snap.nodes : [];
    const shares = [];
    for (const node of nodes) {
      for (const card of Array.isArray(node.cards) ? node.cards : []) {
        const cap = num(card.cores);
        if (cap) shares.push((num((card.used || {}).cores) || 0) / cap);
      }
    }
    return shares.length ? shares.reduce((a, b) => a + b, 0) / shares.length : 0;
  }

  function tile(title, value, detail, testid) {
    return h('div', { class: 'tile', testid },
      h('h3', { class: 'tile-title' }, title),
      h('p', { class: 'tile-value' }, value),
      detail ? h('p', { class: 'tile-detail' }, detail) : null);
  }

  /** The cluster's cards per vendor, each vendor's cores in its own units. */
  function vendorsTile(vendors) {
    return h('div', { class: 'tile tile-vendors', testid: 'summary-vendors' },
      h('h3', { class: 'tile-title' }, 'Vendors'),
      h('ul', { class: 'vendor-list' }, vendors.map((v) => h('li', { testid: `summary-vendor-${v.vendor}` },
        h('span', { class: 'vendor-name' }, String(v.vendor ?? '')), ' ',
        `${fmtCount(v.cards)} card${v.cards === 1 ? '' : 's'} · ${fmtMiB(v.used_memory_mib)} of ${fmtMiB(v.memory_mib)} · `
          + `${fmtCount(v.used_cores)} of ${fmtCount(v.cores)} cores`))));
  }

  function summary(snap) {
    const c = snap.cluster || {};
    const vendors = (Array.isArray(c.vendors) ? c.vendors : []).filter((v) => v && typeof v === 'object');
    const memFraction = num(c.memory_mib) ? (num(c.used_memory_mib) || 0) / c.memory_mib : 0;
    // one vendor: its cores; several: each card's share of its own cores, averaged
    // (a Moore Threads card has 16, an NVIDIA card 100)
    const oneUnit = vendors.length <= 1;
    const coreFraction = oneUnit
      ? (num(c.cores) ? (num(c.used_cores) || 0) / c.cores : 0)
      : cardsCoreFraction(snap);
    const fits = Array.isArray(c.fits) ? c.fits : [];
    const fitsEl = h('div', { class: 'tile tile-fits', testid: 'fits' },
      h('h3', { class: 'tile-title' }, 'Still fits'),
      fits.length
        ? h('ul', { class: 'fits-list' }, fits.map((kind) => h('li', null,
          h('span', { class: 'fits-count' }, `${fmtCount(kind.fits)} ×`), ' ',
          h('span', { class: 'fits-kind' }, String(kind.label ?? '')),
          num(kind.weight) !== null ? h('span', { class: 'fits-weight' }, ` (${fmtFraction(kind.weight)} of pods)`) : null)))
        : h('p', { class: 'tile-detail' }, snap.report_at ? 'No learned pod kinds yet' : 'No scheduler report'));
    const memBar = bar({
      label: 'Cluster memory allocated', now: Math.round(num(c.used_memory_mib) || 0), max: Math.round(num(c.memory_mib) || 0),
      valueText: `${fmtMiB(c.used_memory_mib)} of ${fmtMiB(c.memory_mib)} allocated, ${fmtMiB(c.measured_memory_mib)} measured`,
      parts: [
        { cls: 'alloc', fraction: memFraction },
        { cls: 'measured', fraction: num(c.memory_mib) ? (num(c.measured_memory_mib) || 0) / c.memory_mib : 0 },
      ],
    });
    const coreBar = bar({
      label: 'Cluster cores allocated', now: Math.round(coreFraction * 100), max: 100,
      valueText: `${fmtFraction(coreFraction)} of the cards' cores allocated`,
      parts: [{ cls: 'alloc', fraction: coreFraction }],
    });
    const frag = num(c.fragmentation);
    return h('section', { class: 'summary', 'aria-labelledby': 'summary-title' },
      h('h2', { id: 'summary-title', class: 'sr-only' }, 'Summary'),
      h('div', { class: 'tiles' },
        tile('Cards', fmtCount(c.cards), `on ${fmtCount(c.nodes)} node${c.nodes === 1 ? '' : 's'}`, 'summary-cards'),
        h('div', { class: 'tile', testid: 'summary-memory' },
          h('h3', { class: 'tile-title' }, 'Memory'),
          h('p', { class: 'tile-value' }, `${fmtMiB(c.used_memory_mib)} `, h('span', { class: 'of' }, `of ${fmtMiB(c.memory_mib)}`)),
          memBar,
          h('p', { class: 'tile-detail' }, `${fmtFraction(memFraction)} allocated · ${fmtMiB(c.measured_memory_mib)} measured`)),
        h('div', { class: 'tile', testid: 'summary-cores' },
          h('h3', { class: 'tile-title' }, 'Cores'),
          h('p', { class: 'tile-value' }, `${fmtFraction(coreFraction)} `, h('span', { class: 'of' }, 'allocated')),
          coreBar,
          h('p', { class: 'tile-detail' }, oneUnit
            ? `${fmtCount(c.used_cores)} of ${fmtCount(c.cores)} cores`
            : 'of each card\'s cores, averaged over the cards')),
        tile('Pods', fmtCount(c.pods), 'holding GPU shares', 'summary-pods'),
        h('div', { class: `tile ${frag !== null && frag >= FRAGMENTED ? 'tile-warn' : ''}` },
          h('h3', { class: 'tile-title' }, 'Fragmentation'),
          h('p', { class: 'tile-value', testid: 'cluster-fragmentation' }, fmtFraction(frag)),
          h('p', { class: 'tile-detail', testid: 'cluster-fragmentation-detail' }, fragmentationNote(frag, snap.report_at, allNodeCards(snap)))),
        fitsEl,
        // with other vendors' cards: each vendor's, a row of its own
        vendors.some((v) => v.vendor !== 'nvidia') ? vendorsTile(vendors) : null));
  }

  function allNodeCards(snap) {
    const nodes = Array.isArray(snap.nodes) ? snap.nodes : [];
    return nodes.flatMap((node) => (Array.isArray(node.cards) ? node.cards : []));
  }

  /** Whether any of these cards has anything allocated (memory, cores or slots). */
  function anyAllocated(cards) {
    return cards.some((card) => card && card.used && typeof card.used === 'object'
      && Object.values(card.used).some((v) => num(v)));
  }

  /**
   * What a fragmentation figure means, or why there is none: with nothing
   * allocated there is nothing to fragment (the server gives no figure then).
   */
  function fragmentationNote(frag, reportAt, cards) {
    if (frag !== null) return 'of the free share is in fragments';
    if (!reportAt) return 'no scheduler report';
    if (!cards.length) return 'no cards';
    return anyAllocated(cards) ? 'no free share' : 'nothing allocated: nothing to fragment';
  }

  /** Cores of a card as its vendor counts them (percent of a card for most, 16 a card for Moore Threads). */
  function fmtCores(cores, capacity) {
    return num(capacity) === null ? `${fmtCount(cores)} cores` : `${fmtCount(cores)}/${fmtCount(capacity)} cores`;
  }

  /**
   * The cores one container was granted: none asked is no core limit (as
   * HAMi's gpucores 0: the container may use the whole card's compute), not
   * "0 cores".
   */
  function fmtGrantCores(cores, capacity) {
    return num(cores) === 0 ? 'no core limit' : fmtCores(cores, capacity);
  }

  function cardPods(card) {
    const pods = Array.isArray(card.pods) ? card.pods : [];
    const items = pods.map((pod) => h('li', null,
      podLink(pod.namespace, pod.name),
      h('span', { class: 'pod-share' }, ` ${fmtAskedMiB(pod.memory_mib)} · ${fmtGrantCores(pod.cores, card.cores)}`)));
    if (card.others && num(card.others.pods)) {
      items.push(h('li', { class: 'muted' },
        `+ ${fmtCount(card.others.pods)} pod${card.others.pods === 1 ? '' : 's'} in other namespaces (${fmtAskedMiB(card.others.memory_mib)} · ${fmtCores(card.others.cores, card.cores)})`));
    }
    if (!items.length) return h('p', { class: 'card-empty muted' }, 'No pods');
    return h('ul', { class: 'card-pods', 'aria-label': `Pods on card ${card.index}` }, items);
  }

  function cardTile(node, card) {
    const state = cardState(card);
    const used = card.used || {};
    const measured = card.measured || {};
    const memCap = num(card.memory_mib) || 0;
    const memUsed = num(used.memory_mib) || 0;
    const memMeasured = num(measured.memory_mib);
    const coreCap = num(card.cores) || 0;
    const coreUsed = num(used.cores) || 0;
    const sm = num(measured.sm_percent);
    const where = `${node.name} card ${card.index}`;
    const memBar = bar({
      label: `Memory allocated on ${where}`, now: Math.round(memUsed), max: Math.round(memCap),
      valueText: `${fmtMiB(memUsed)} of ${fmtMiB(memCap)} allocated${memMeasured === null ? '' : `, ${fmtMiB(memMeasured)} measured`}`,
      parts: [
        { cls: 'alloc', fraction: memCap ? memUsed / memCap : 0 },
        { cls: 'measured', fraction: memCap && memMeasured !== null ? memMeasured / memCap : 0 },
      ],
    });
    const coreBar = bar({
      label: `Cores allocated on ${where}`, now: Math.round(coreUsed), max: Math.round(coreCap),
      valueText: `${fmtPercent(coreCap ? (coreUsed / coreCap) * 100 : 0)} of cores allocated${sm === null ? '' : `, SM ${fmtPercent(sm)} busy`}`,
      parts: [
        { cls: 'alloc', fraction: coreCap ? coreUsed / coreCap : 0 },
        { cls: 'measured', fraction: sm === null ? 0 : sm / 100 },
      ],
    });
    const badges = [badge(state.label, state.key, STATE_HELP[state.key])];
    if (state.cordoned) badges.push(badge('Cordoned', 'cordoned', 'Takes no new pods'));
    if (card.present === false) badges.push(badge('Missing', 'bad', 'Its device plugin no longer lists this card'));
    return h('article', { class: `card state-${state.key}`, testid: `card-${card.uuid}`, 'aria-label': `Card ${card.index}, ${card.model}` },
      h('header', { class: 'card-head' },
        h('h3', { class: 'card-title' },
          h('span', { class: 'card-index' }, `#${card.index}`), ' ',
          h('span', { class: 'card-model' }, String(card.model ?? ''))),
        h('div', { class: 'badges' }, badges)),
      h('p', { class: 'card-meta' },
        h('span', { class: 'card-vendor', testid: `vendor-${card.uuid}` }, String(card.vendor ?? '')),
        // how gpuslice shares NVIDIA's cards; other vendors' are shared by their plugins
        isNvidia(card) ? [' · ', h('span', null, String(card.mode ?? ''))] : null,
        ' · ', h('span', null, `${fmtCount(used.slots)}/${fmtCount(card.slots)} slots`),
        ' · ', h('code', { class: 'uuid', title: card.uuid }, String(card.uuid ?? ''))),
      cardLayers(card),
      h('div', { class: 'metric' },
        h('div', { class: 'metric-head' }, h('span', { class: 'metric-name' }, 'Memory'),
          h('span', { class: 'metric-value' }, `${fmtMiB(memUsed)} / ${fmtMiB(memCap)}`)),
        memBar,
        h('p', { class: 'metric-sub' }, memMeasured === null ? 'no telemetry' : `${fmtMiB(memMeasured)} measured`)),
      // cores in the vendor's units: percent of a card for most, 16 a card for Moore Threads
      h('div', { class: 'metric' },
        h('div', { class: 'metric-head' }, h('span', { class: 'metric-name' }, 'Cores'),
          h('span', { class: 'metric-value', testid: `cores-${card.uuid}` }, `${fmtCount(coreUsed)} / ${fmtCount(coreCap)}`)),
        coreBar,
        h('p', { class: 'metric-sub' }, sm === null ? 'no telemetry' : `SM ${fmtPercent(sm)} busy`)),
      cardPods(card),
      cardHistoryLink(node, card));
  }

  function cardHref(node, uuid) {
    return `#/cards/${encodeURIComponent(node)}/${encodeURIComponent(uuid)}`;
  }

  function cardHistoryLink(node, card) {
    return h('p', { class: 'card-history-link' },
      h('a', { href: cardHref(node.name, card.uuid), testid: `history-link-${card.uuid}` },
        'Last hour', h('span', { class: 'sr-only' }, ` of ${node.name} card ${card.index}`)));
  }

  function isNvidia(card) {
    return !card.vendor || card.vendor === 'nvidia';
  }

  // Which enforcement layers hold the card's containers to their grants, as its node reports.
  const LAYER_NAMES = [['driver', 'driver'], ['agent_memory', 'agent memory'], ['agent_compute', 'agent compute'], ['interposer', 'interposer']];
  function cardLayers(card) {
    if (!isNvidia(card)) {
      return h('p', { class: 'card-layers', testid: `layers-${card.uuid}` }, 'Enforced by the vendor\'s device plugin');
    }
    const layers = card.layers;
    if (!layers || typeof layers !== 'object') {
      return h('p', { class: 'card-layers', testid: `layers-${card.uuid}` }, 'Enforcement layers: not reported');
    }
    const on = LAYER_NAMES.filter(([key]) => layers[key] === 'enforcing').map(([, name]) => name);
    const off = LAYER_NAMES.filter(([key]) => layers[key] !== 'enforcing').map(([, name]) => name);
    const note = typeof layers.driver_note === 'string' && layers.driver_note ? ` (driver: ${layers.driver_note})` : '';
    return h('p', { class: 'card-layers', testid: `layers-${card.uuid}` },
      `Enforced by ${on.length ? on.join(', ') : 'nothing'}`,
      off.length ? ` · missing: ${off.join(', ')}` : '', note);
  }

  function nodeSection(node) {
    const cards = Array.isArray(node.cards) ? node.cards : [];
    const frag = num(node.fragmentation);
    const titleId = `node-title-${node.name}`;
    const badges = [node.live ? badge('Live', 'live', 'The node reports in') : badge('Not reporting', 'down', 'No heartbeat from its device plugin')];
    if (node.rebuilt === false) badges.push(badge('Rebuilding', 'warn', 'Its ledger is being rebuilt: takes no reservations yet'));
    if (frag !== null && frag >= FRAGMENTED) {
      badges.push(badge(`${fmtFraction(frag)} fragmented`, 'stranded', 'This share of its free capacity is in fragments the common pod kinds do not fit'));
    }
    return h('section', { class: 'node', testid: `node-${node.name}`, 'aria-labelledby': titleId },
      h('header', { class: 'node-head' },
        h('h2', { class: 'node-title', id: titleId }, String(node.name)),
        h('div', { class: 'badges' }, badges),
        h('p', { class: 'node-stats' },
          h('span', null, `${cards.length} card${cards.length === 1 ? '' : 's'}`),
          ' · ', h('span', { testid: `fragmentation-${node.name}` }, frag === null && !anyAllocated(cards)
            ? 'nothing allocated' : `fragmentation ${fmtFraction(frag)}`),
          num(node.free_share) !== null ? [' · ', h('span', null, `${trimZeros((node.free_share / 1000).toFixed(2))} GPU free`)] : null)),
      cards.length
        ? h('div', { class: 'cards' }, cards.map((card) => cardTile(node, card)))
        : h('p', { class: 'muted' }, 'No cards registered'));
  }

  function clusterView(ctx) {
    const heading = h('h1', { tabindex: '-1', class: 'view-title' }, 'Cluster');
    const stamp = h('p', { class: 'stamp muted', 'aria-live': 'off' }, 'Loading…');
    const content = h('div', { class: 'cluster-content', testid: 'cluster-content' });
    const banner = problemBanner('The cluster view', [content]);
    const history = historySection(ctx, { id: 'cluster', query: '', charts: clusterCharts });
    ctx.root.append(h('div', { class: 'view-head' }, heading, stamp), banner.el, legend(), content, history.el);
    let version = null;

    function render(snap) {
      if (!snap || typeof snap !== 'object') return;
      if (snap.version === version && version !== null) return;
      version = snap.version;
      ctx.ok();
      const nodes = Array.isArray(snap.nodes) ? snap.nodes : [];
      preserveFocus(content, () => {
        setChildren(content, summary(snap),
          nodes.length ? nodes.map(nodeSection) : h('p', { class: 'empty' }, 'No GPU nodes are registered.'));
      });
      banner.set(snap.problem);
      const at = parseTime(snap.at);
      setChildren(stamp, 'Snapshot ', at ? timeEl(snap.at) : '—',
        snap.report_at ? '' : ' · no scheduler report',
        banner.stale() ? ' · not live' : '');
    }

    api('api/v1/cluster', { signal: ctx.signal }).then(render).catch((err) => ctx.fail(err));
    ctx.onStop(openStream('view=cluster', (name, data) => {
      if (name === 'cluster') {
        render(data);
        history.refresh();
      }
    }));
    return heading;
  }

  /** One card: its tile as the cluster view shows it, and its last hour. */
  function cardView(ctx, nodeName, uuid) {
    const heading = h('h1', { tabindex: '-1', class: 'view-title' }, `Card ${uuid} on ${nodeName}`);
    const content = h('div', { class: 'card-content', testid: 'card-content' }, h('p', { class: 'muted' }, 'Loading…'));
    const query = new URLSearchParams({ node: nodeName, card: uuid }).toString();
    const history = historySection(ctx, { id: 'card', query, charts: (doc) => usageCharts('card', doc) });
    ctx.root.append(h('nav', { class: 'crumbs', 'aria-label': 'Breadcrumb' }, h('a', { href: '#/cluster' }, 'Cluster'), ' / ', h('span', { 'aria-current': 'page' }, `${nodeName} / ${uuid}`)),
      h('div', { class: 'view-head' }, heading), content, history.el);
    let version = null;

    function render(snap) {
      if (!snap || typeof snap !== 'object' || (snap.version === version && version !== null)) return;
      version = snap.version;
      ctx.ok();
      const node = (Array.isArray(snap.nodes) ? snap.nodes : []).find((n) => n && n.name === nodeName);
      const card = node && Array.isArray(node.cards) ? node.cards.find((c) => c && c.uuid === uuid) : null;
      preserveFocus(content, () => setChildren(content, card
        ? h('div', { class: 'cards' }, cardTile(node, card))
        : h('p', { class: 'empty', testid: 'card-missing' }, `No card ${uuid} is registered on ${nodeName}.`)));
    }

    api('api/v1/cluster', { signal: ctx.signal }).then(render).catch((err) => ctx.fail(err));
    ctx.onStop(openStream('view=cluster', (name, data) => {
      if (name === 'cluster') {
        render(data);
        history.refresh();
      }
    }));
    return heading;
  }

  /** Replaces content and puts focus back on the element with the same test id. */
  function preserveFocus(container, replace) {
    const active = document.activeElement;
    const key = active && container.contains(active) ? active.getAttribute('data-testid') || active.id : null;
    replace();
    if (key) {
      const again = container.querySelector(`[data-testid="${CSS.escape(key)}"], #${CSS.escape(key)}`);
      if (again) again.focus({ preventScroll: true });
    }
  }

  // ------------------------------------------------------------ pods list

  function stateBadge(state) {
    const kind = { denied: 'bad', failed: 'bad', released: 'muted', allocated: 'ok', bound: 'info', reserved: 'info' }[state] || 'muted';
    return badge(String(state ?? 'unknown'), kind);
  }

  function podsView(ctx) {
    const heading = h('h1', { tabindex: '-1', class: 'view-title' }, 'Pods');
    const search = h('input', { id: 'pods-filter', type: 'search', autocomplete: 'off', placeholder: 'namespace or name', testid: 'pods-filter' });
    const stateSelect = h('select', { id: 'pods-state', testid: 'pods-state' },
      h('option', { value: '' }, 'Any state'), STATES.map((s) => h('option', { value: s }, s)));
    const count = h('p', { class: 'muted', role: 'status' });
    const body = h('tbody');
    const table = h('table', { class: 'table pods-table', testid: 'pods-table' },
      h('caption', { class: 'sr-only' }, 'Pods with GPU shares and recent admissions, newest first'),
      h('thead', null, h('tr', null, ['Pod', 'State', 'Node', 'Since', 'Reason'].map((t) => h('th', { scope: 'col' }, t)))),
      body);
    const form = h('form', { class: 'filters', role: 'search', 'aria-label': 'Filter pods', onsubmit: (e) => e.preventDefault() },
      h('div', { class: 'field' }, h('label', { for: 'pods-filter' }, 'Filter'), search),
      h('div', { class: 'field' }, h('label', { for: 'pods-state' }, 'State'), stateSelect));
    ctx.root.append(h('div', { class: 'view-head' }, heading), form, count, h('div', { class: 'table-wrap' }, table));
    let pods = [];

    function render() {
      const text = search.value.trim().toLowerCase();
      const state = stateSelect.value;
      const shown = pods.filter((p) => (!state || p.state === state)
        && (!text || `${p.namespace}/${p.name}`.toLowerCase().includes(text)));
      preserveFocus(body, () => {
        body.replaceChildren(...shown.map((p) => h('tr', { testid: `pod-row-${p.namespace}-${p.name}`, 'data-state': p.state },
          h('td', { 'data-label': 'Pod' }, podLink(p.namespace, p.name)),
          h('td', { 'data-label': 'State' }, stateBadge(p.state)),
          h('td', { 'data-label': 'Node' }, p.node ? String(p.node) : h('span', { class: 'muted' }, '—')),
          h('td', { 'data-label': 'Since' }, timeEl(p.since, { ago: true })),
          h('td', { 'data-label': 'Reason', class: 'reason-cell' }, p.reason ? String(p.reason) : h('span', { class: 'muted' }, '—')))));
      });
      count.textContent = shown.length === pods.length
        ? `${pods.length} pod${pods.length === 1 ? '' : 's'}`
        : `${shown.length} of ${pods.length} pods`;
    }

    let inFlight = false;
    let again = false;
    async function load() {
      if (inFlight) {
        again = true;
        return;
      }
      inFlight = true;
      try {
        const doc = await api('api/v1/pods', { signal: ctx.signal });
        pods = Array.isArray(doc.pods) ? doc.pods : [];
        ctx.ok();
        render();
      } catch (err) {
        ctx.fail(err);
      } finally {
        inFlight = false;
        if (again && !ctx.signal.aborted) {
          again = false;
          load();
        }
      }
    }
    search.addEventListener('input', render);
    stateSelect.addEventListener('change', render);
    load();
    // The pods list has no stream of its own: reload it when the cluster changes.
    ctx.onStop(openStream('view=cluster', (name) => {
      if (name === 'cluster') load();
    }));
    return heading;
  }

  // ------------------------------------------------------------ one pod

  function usageBlock(container, card, usage) {
    const limitBytes = usage && num(usage.limit_bytes) ? usage.limit_bytes : (num(card.memory_mib) || 0) * 1048576;
    const limitMiB = limitBytes / 1048576;
    const limitText = fmtAskedMiB(limitMiB); // the limit asked, in its MiB
    const used = usage ? num(usage.used_bytes) : null;
    const peak = usage ? num(usage.peak_bytes) : null;
    const usedMiB = used === null ? null : Math.round((used / 1048576) * 10) / 10;
    const fraction = used !== null && limitBytes ? used / limitBytes : 0;
    const valueText = used === null
      ? 'no telemetry yet'
      : `${fmtBytes(used)} of ${limitText} used${peak !== null ? `, peak ${fmtBytes(peak)}` : ''}`;
    const memBar = bar({
      label: `Memory used by ${container.name} on card ${card.index}`,
      testid: `mem-bar-${container.name}-${card.uuid}`,
      now: usedMiB, max: Math.round(limitMiB * 10) / 10, valueText,
      parts: [{ cls: 'used', fraction }],
      marker: peak !== null && limitBytes ? { cls: 'peak', fraction: peak / limitBytes, label: `peak ${fmtBytes(peak)}` } : null,
    });
    const stats = h('dl', { class: 'stats' },
      h('div', null, h('dt', null, 'Used'), h('dd', { testid: `mem-used-${container.name}-${card.uuid}` }, used === null ? '—' : `${fmtBytes(used)} (${fmtPercent(fraction * 100)})`)),
      h('div', null, h('dt', null, 'Peak'), h('dd', null, peak === null ? '—' : fmtBytes(peak))),
      h('div', null, h('dt', null, 'SM busy'), h('dd', null, usage ? fmtPercent(num(usage.sm_percent)) : '—')),
      h('div', null, h('dt', null, 'Throttled'), h('dd', null, usage ? fmtDurationNs(num(usage.throttled_ns)) : '—')),
      h('div', { class: usage && usage.denied_allocations > 0 ? 'stat-bad' : null },
        h('dt', null, 'Denied allocations'), h('dd', null, usage ? fmtCount(num(usage.denied_allocations)) : '—')));
    return h('div', { class: 'usage' },
      h('div', { class: 'metric-head' }, h('span', { class: 'metric-name' }, 'Memory'),
        h('span', { class: 'metric-value' }, used === null ? `limit ${limitText}` : `${fmtBytes(used)} / ${limitText}`)),
      memBar,
      h('p', { class: 'metric-sub' }, used === null ? 'no telemetry yet' : valueText,
        usage && usage.at ? [' · as of ', timeEl(usage.at)] : null),
      stats);
  }

  /** A card's memory limit as the container asked for it: a share of the card, or MiB. */
  function limitAsked(asked, card) {
    const percent = asked && typeof asked === 'object' ? num(asked.memory_percent) : null;
    return percent === null
      ? `limit ${fmtAskedMiB(card.memory_mib)}`
      : `limit ${percent}% of the card (${fmtAskedMiB(card.memory_mib)})`;
  }

  function containerSection(container) {
    const usages = Array.isArray(container.usage) ? container.usage : [];
    const cards = Array.isArray(container.cards) ? container.cards : [];
    const titleId = `container-${container.name}`;
    return h('section', { class: 'container', testid: `container-${container.name}`, 'aria-labelledby': titleId },
      h('h3', { id: titleId }, 'Container ', h('code', null, String(container.name))),
      cards.length ? h('div', { class: 'cards' }, cards.map((card) => {
        const usage = usages.find((u) => u.uuid === card.uuid) || null;
        return h('article', { class: 'card pod-card', testid: `pod-card-${container.name}-${card.uuid}`, 'aria-label': `Card ${card.index}, ${card.model ?? ''}` },
          h('header', { class: 'card-head' },
            h('h4', { class: 'card-title' }, h('span', { class: 'card-index' }, `#${card.index}`), ' ', h('span', { class: 'card-model' }, String(card.model ?? ''))),
            card.mig ? h('div', { class: 'badges' }, badge(`MIG ${card.mig.profile ?? ''}`, 'info')) : null),
          h('p', { class: 'card-meta' },
            card.vendor ? [h('span', null, String(card.vendor)), ' · '] : null,
            h('span', { testid: `pod-memory-${container.name}-${card.uuid}` }, limitAsked(container.asked, card)), ' · ',
            h('span', { testid: `pod-cores-${container.name}-${card.uuid}` }, fmtGrantCores(card.cores, card.card_cores)), ' · ',
            h('code', { class: 'uuid', title: card.uuid }, String(card.uuid ?? ''))),
          usageBlock(container, card, usage));
      })) : h('p', { class: 'muted' }, 'No cards assigned'));
  }

  function story(events) {
    if (!events.length) return h('p', { class: 'muted' }, 'No events in the console\'s window.');
    return h('ol', { class: 'timeline', testid: 'story' }, events.map((e) => h('li', { class: `tl-item tl-${String(e.type).split('.').pop()}`, testid: 'story-event', 'data-type': e.type },
      h('span', { class: 'tl-dot', 'aria-hidden': 'true' }),
      h('div', { class: 'tl-body' },
        h('p', { class: 'tl-head' }, typeBadge(e.type), ' ', timeEl(e.time), ' ', h('span', { class: 'muted' }, `from ${e.source ?? '?'}`)),
        e.reason ? h('p', { class: 'tl-reason' }, String(e.reason)) : null))));
  }

  function podView(ctx, namespace, name) {
    const heading = h('h1', { tabindex: '-1', class: 'view-title pod-title' },
      h('span', { class: 'ns' }, `${namespace}/`), h('span', null, name));
    const content = h('div', { class: 'pod-content' }, h('p', { class: 'muted' }, 'Loading…'));
    const history = historySection(ctx, {
      id: 'pod', query: new URLSearchParams({ namespace, name }).toString(), charts: (doc) => usageCharts('pod', doc),
    });
    ctx.root.append(h('nav', { class: 'crumbs', 'aria-label': 'Breadcrumb' }, h('a', { href: '#/pods' }, 'Pods'), ' / ', h('span', { 'aria-current': 'page' }, `${namespace}/${name}`)),
      h('div', { class: 'view-head' }, heading), content, history.el);
    let last = null;

    function render(doc) {
      if (!doc || typeof doc !== 'object') return;
      const serial = JSON.stringify(doc);
      if (serial === last) return;
      last = serial;
      ctx.ok();
      const containers = Array.isArray(doc.containers) ? doc.containers : [];
      const events = Array.isArray(doc.story) ? doc.story : [];
      const problem = doc.reason || doc.state === 'denied' || doc.state === 'failed';
      const reasonTitle = { denied: 'Denied', failed: 'Failed' }[doc.state] || 'Reason';
      preserveFocus(content, () => setChildren(content,
        problem ? h('section', { class: `reason-box reason-${doc.state}`, 'aria-labelledby': 'pod-reason-title' },
          h('h2', { id: 'pod-reason-title' }, reasonTitle),
          h('p', { testid: 'pod-reason', class: 'reason-text' }, doc.reason ? String(doc.reason) : 'No reason was recorded.')) : null,
        h('dl', { class: 'facts' },
          h('div', null, h('dt', null, 'State'), h('dd', { testid: 'pod-state' }, stateBadge(doc.state))),
          h('div', null, h('dt', null, 'Node'), h('dd', null, doc.node ? String(doc.node) : '—')),
          h('div', null, h('dt', null, 'Policy'), h('dd', null, doc.policy ? String(doc.policy).replace(/,/g, ', ') : '—')),
          h('div', null, h('dt', null, 'UID'), h('dd', null, doc.uid ? h('code', null, String(doc.uid)) : '—'))),
        h('section', { class: 'containers', 'aria-labelledby': 'containers-title' },
          h('h2', { id: 'containers-title' }, 'Containers'),
          containers.length ? containers.map(containerSection) : h('p', { class: 'muted' }, 'No GPU containers placed.')),
        h('section', { class: 'story', 'aria-labelledby': 'story-title' },
          h('h2', { id: 'story-title' }, 'Story'),
          story(events))));
    }

    api(`api/v1/pods/${encodeURIComponent(namespace)}/${encodeURIComponent(name)}`, { signal: ctx.signal })
      .then(render)
      .catch((err) => {
        if (err instanceof ApiError && err.status === 404) {
          content.replaceChildren(h('p', { class: 'empty', testid: 'pod-missing' }, err.message));
        } else ctx.fail(err);
      });
    const query = new URLSearchParams({ view: 'pod', namespace, name });
    ctx.onStop(openStream(query.toString(), (event, data) => {
      if (event === 'pod') {
        render(data);
        history.refresh();
      }
    }));
    return heading;
  }

  // ------------------------------------------------------------ audit

  function shortType(type) {
    return typeof type === 'string' ? type.replace(/^io\.gpuslice\./, '') : String(type);
  }

  function typeBadge(type) {
    const t = shortType(type);
    const kind = /denied|failed|kill/.test(t) ? 'bad' : /released/.test(t) ? 'muted' : /allocated/.test(t) ? 'ok' : 'info';
    return badge(t, kind);
  }

  /**
   * Cores an event names, in the units they were asked in: percent of a card
   * for NVIDIA's (whose records leave the vendor out) and most vendors' is
   * not every vendor's (16 a card for Moore Threads, AI cores for Ascend), so
   * another vendor's are a count; none is no core limit.
   */
  function fmtEventCores(cores, vendor) {
    const n = num(cores);
    if (n === 0) return 'no core limit';
    if (vendor && vendor !== 'nvidia') return `${fmtCount(n)} cores`;
    return `${fmtPercent(n)} cores`;
  }

  function eventDetail(e) {
    const d = e.data && typeof e.data === 'object' ? e.data : {};
    const parts = [];
    if (d.reason) parts.push(String(d.reason));
    if (d.policy) parts.push(`policy ${d.policy}`);
    if (Array.isArray(d.containers)) {
      for (const c of d.containers) {
        if (!c || typeof c !== 'object') continue;
        if (Array.isArray(c.devices)) {
          const cards = c.devices.map((g) => `card …${String(g.uuid ?? '').slice(-8)} (${fmtAskedMiB(num(g.memory_mib))}, ${fmtEventCores(g.cores, c.vendor)}${g.mig && g.mig.profile ? `, MIG ${g.mig.profile}` : ''})`);
          parts.push(`${c.name} → ${cards.join(', ')}`);
        } else if (c.memory) {
          const mem = c.memory.mib ? fmtAskedMiB(num(c.memory.mib)) : c.memory.percent ? `${c.memory.percent}% memory` : '';
          parts.push(`${c.name} asks ${c.count ?? 1} × ${mem}, ${fmtEventCores(c.cores ?? 0, c.vendor)}`);
        }
      }
    }
    if (d.container) parts.unshift(`for container ${d.container}`);
    if (Array.isArray(d.warnings)) parts.push(...d.warnings.map(String));
    return parts.join(' · ');
  }

  function auditRow(e) {
    const d = e.data && typeof e.data === 'object' ? e.data : {};
    const pod = d.pod && typeof d.pod === 'object' ? d.pod : null;
    return h('tr', { testid: 'audit-event', 'data-type': shortType(e.type), 'data-id': e.id },
      h('td', { 'data-label': 'Time' }, timeEl(e.time)),
      h('td', { 'data-label': 'Type' }, typeBadge(e.type)),
      h('td', { 'data-label': 'Pod' }, pod && pod.name ? podLink(pod.namespace || 'default', pod.name) : h('span', { class: 'muted' }, '—')),
      h('td', { 'data-label': 'Node' }, d.node ? String(d.node) : h('span', { class: 'muted' }, '—')),
      h('td', { 'data-label': 'Detail', class: 'detail-cell' }, eventDetail(e) || h('span', { class: 'muted' }, '—')));
  }

  const AUDIT_FIELDS = [
    { key: 'since', label: 'Since', placeholder: '15m, 2h or an ISO time' },
    { key: 'node', label: 'Node', placeholder: 'any node' },
    { key: 'namespace', label: 'Namespace', placeholder: 'any namespace' },
    { key: 'pod', label: 'Pod', placeholder: 'name or UID' },
  ];

  function auditView(ctx, params) {
    const heading = h('h1', { tabindex: '-1', class: 'view-title' }, 'Audit');
    const filters = new URLSearchParams();
    for (const f of AUDIT_FIELDS) {
      const v = (params.get(f.key) || '').trim();
      if (v) filters.set(f.key, v);
    }
    const types = (params.get('type') || '').split(',').map((t) => t.trim()).filter((t) => EVENT_TYPES.includes(t));
    if (types.length) filters.set('type', types.join(','));
    const follow = params.get('follow') !== '0';

    const inputs = AUDIT_FIELDS.map((f) => h('div', { class: 'field' },
      h('label', { for: `audit-${f.key}` }, f.label),
      h('input', { id: `audit-${f.key}`, name: f.key, type: 'text', autocomplete: 'off', spellcheck: 'false', placeholder: f.placeholder, value: filters.get(f.key) || '', testid: `audit-${f.key}` })));
    const typeBoxes = h('fieldset', { class: 'types' },
      h('legend', null, 'Types'),
      h('div', { class: 'type-list' }, EVENT_TYPES.map((t) => h('label', { class: 'check' },
        h('input', { type: 'checkbox', name: 'type', value: t, checked: types.includes(t), testid: `audit-type-${t}` }),
        ` ${t}`))));
    const followBox = h('input', { type: 'checkbox', id: 'audit-follow', role: 'switch', checked: follow, testid: 'follow' });
    const exportLink = h('a', { class: 'button', href: `api/v1/audit/export?${filters}`, download: 'gpuslice-audit.jsonl', testid: 'export' }, 'Export JSON Lines');
    const form = h('form', { class: 'filters audit-filters', role: 'search', 'aria-label': 'Audit filters', testid: 'audit-form' },
      inputs, typeBoxes,
      h('div', { class: 'form-actions' },
        h('button', { type: 'submit', class: 'primary', testid: 'audit-apply' }, 'Apply filters'),
        h('a', { href: '#/audit', class: 'button' }, 'Clear'),
        h('label', { class: 'check follow', for: 'audit-follow' }, followBox, ' Follow live'),
        exportLink));
    const status = h('p', { class: 'muted', role: 'status', testid: 'audit-status' }, 'Loading…');
    const body = h('tbody');
    const tableWrap = h('div', { class: 'table-wrap' });
    const banner = problemBanner('The audit view', [tableWrap]);
    const table = h('table', { class: 'table audit-table', testid: 'audit-table' },
      h('caption', { class: 'sr-only' }, 'Audit events, newest first'),
      h('thead', null, h('tr', null, ['Time', 'Type', 'Pod', 'Node', 'Detail'].map((t) => h('th', { scope: 'col' }, t)))),
      body);
    tableWrap.append(table);
    ctx.root.append(h('div', { class: 'view-head' }, heading), banner.el, form, status, tableWrap);

    form.addEventListener('submit', (event) => {
      event.preventDefault();
      const next = new URLSearchParams();
      for (const f of AUDIT_FIELDS) {
        const v = form.elements[f.key].value.trim();
        if (v) next.set(f.key, v);
      }
      const chosen = [...form.querySelectorAll('input[name="type"]:checked')].map((i) => i.value);
      if (chosen.length) next.set('type', chosen.join(','));
      if (!followBox.checked) next.set('follow', '0');
      const hash = `#/audit${next.toString() ? `?${next}` : ''}`;
      if (location.hash === hash) route();
      else location.hash = hash;
    });

    exportLink.addEventListener('click', async (event) => {
      if (!token) return; // a plain download works without a token
      event.preventDefault();
      try {
        const res = await fetch(exportLink.getAttribute('href'), { headers: authHeaders('application/x-ndjson'), cache: 'no-store' });
        if (!res.ok) throw new ApiError(res.status, await errorText(res));
        const url = URL.createObjectURL(await res.blob());
        const a = h('a', { href: url, download: 'gpuslice-audit.jsonl', class: 'sr-only' });
        document.body.appendChild(a);
        a.click();
        a.remove();
        setTimeout(() => URL.revokeObjectURL(url), 10000);
      } catch (err) {
        showAlert(`Export failed: ${err.message}`);
      }
    });

    const seen = new Set();
    let events = [];
    let truncated = false;

    function renderStatus() {
      status.textContent = `${events.length} event${events.length === 1 ? '' : 's'}, newest first${truncated ? ' (older events left out: narrow the filters)' : ''}`;
    }

    function add(list, { prepend }) {
      const fresh = list.filter((e) => e && typeof e === 'object' && typeof e.id === 'string' && !seen.has(e.id));
      if (!fresh.length) return;
      for (const e of fresh) seen.add(e.id);
      fresh.sort((a, b) => (Date.parse(a.time) || 0) - (Date.parse(b.time) || 0));
      events = events.concat(fresh);
      if (prepend) {
        const rows = fresh.map(auditRow).reverse();
        body.prepend(...rows);
      } else {
        events.sort((a, b) => (Date.parse(a.time) || 0) - (Date.parse(b.time) || 0));
        body.replaceChildren(...events.slice().reverse().map(auditRow));
      }
      while (events.length > MAX_AUDIT_ROWS) {
        const old = events.shift();
        seen.delete(old.id);
        if (body.lastElementChild) body.lastElementChild.remove();
      }
      renderStatus();
    }

    async function load(query) {
      const doc = await api(`api/v1/audit?${query}`, { signal: ctx.signal });
      truncated = doc.truncated === true;
      banner.set(doc.problem);
      add(Array.isArray(doc.events) ? doc.events : [], { prepend: false });
      renderStatus();
    }

    /**
     * What happened since the newest event shown, and whether the feed still
     * follows the stream (its `problem`): the stream's events do not say
     * when the feed stops or starts reading again, an answer of the API does.
     */
    function catchUp() {
      const gap = new URLSearchParams(filters);
      if (events.length) gap.set('since', events[events.length - 1].time);
      return api(`api/v1/audit?${gap}`, { signal: ctx.signal }).then((doc) => {
        if (ctx.signal.aborted) return;
        banner.set(doc.problem);
        add(Array.isArray(doc.events) ? doc.events : [], { prepend: false });
      });
    }

    let stopFollow = null;
    let poll = null;
    function startFollow() {
      const query = new URLSearchParams(filters);
      query.set('view', 'audit');
      const stopStream = openStream(query.toString(), (name, data) => {
        if (name === 'audit') add([data], { prepend: true });
      }, {
        // Once connected (again), fill the gap since the newest event shown:
        // what happened between the first load, or the drop, and this stream.
        onOpen: () => {
          catchUp().catch(() => {});
        },
      });
      // While following, ask now and then whether the feed is whole (and fill
      // any gap): one request at a time, none once the view is left.
      let asking = false;
      poll = setInterval(() => {
        if (asking || ctx.signal.aborted) return;
        asking = true;
        catchUp().catch(() => {}).finally(() => {
          asking = false;
        });
      }, PROBLEM_POLL_MS);
      stopFollow = () => {
        clearInterval(poll);
        poll = null;
        stopStream();
      };
    }
    function stopFollowing() {
      if (stopFollow) stopFollow();
      stopFollow = null;
      setLive('paused');
    }
    followBox.addEventListener('change', () => {
      const next = new URLSearchParams(location.hash.split('?')[1] || '');
      if (followBox.checked) {
        next.delete('follow');
        startFollow();
      } else {
        next.set('follow', '0');
        stopFollowing();
      }
      history.replaceState(null, '', `#/audit${next.toString() ? `?${next}` : ''}`);
    });
    ctx.onStop(() => {
      if (stopFollow) stopFollow();
    });

    load(filters.toString()).then(() => {
      if (ctx.signal.aborted) return;
      if (followBox.checked) startFollow();
      else setLive('paused');
    }).catch((err) => {
      status.textContent = '';
      ctx.fail(err);
      setLive('offline');
    });
    return heading;
  }

  // ------------------------------------------------------------ routing

  let current = null;

  function notFound(ctx) {
    const heading = h('h1', { tabindex: '-1', class: 'view-title' }, 'Not found');
    ctx.root.append(heading, h('p', null, 'There is no such view. ', h('a', { href: '#/cluster' }, 'Go to the cluster view.')));
    setLive('paused');
    return heading;
  }

  function parseRoute() {
    const hash = location.hash || '#/cluster';
    if (!hash.startsWith('#/')) return null;
    const q = hash.indexOf('?');
    const path = hash.slice(2, q < 0 ? undefined : q);
    const params = new URLSearchParams(q < 0 ? '' : hash.slice(q + 1));
    let parts;
    try {
      parts = path.split('/').filter((p) => p !== '').map(decodeURIComponent);
    } catch (_) {
      return { name: 'notfound' };
    }
    if (parts.length === 0 || (parts.length === 1 && parts[0] === 'cluster')) return { name: 'cluster' };
    if (parts[0] === 'pods' && parts.length === 1) return { name: 'pods' };
    if (parts[0] === 'pods' && parts.length === 3) return { name: 'pod', namespace: parts[1], pod: parts[2] };
    if (parts[0] === 'audit' && parts.length === 1) return { name: 'audit', params };
    if (parts[0] === 'cards' && parts.length === 3) return { name: 'card', node: parts[1], uuid: parts[2] };
    return { name: 'notfound' };
  }

  function route({ focus = true } = {}) {
    const r = parseRoute();
    if (!r) return; // an in-page anchor such as the skip link
    if (current) current.stop();
    clearAlert();
    const root = h('div', { class: `view view-${r.name}` });
    const controller = new AbortController();
    const stops = [];
    const ctx = {
      root,
      signal: controller.signal,
      onStop: (fn) => stops.push(fn),
      ok: () => {
        if (!controller.signal.aborted) clearAlert();
      },
      fail: (err) => {
        if (controller.signal.aborted || (err && err.name === 'AbortError')) return;
        showAlert(err && err.message ? err.message : String(err));
      },
    };
    current = {
      stop: () => {
        controller.abort();
        for (const fn of stops) fn();
      },
    };
    for (const link of document.querySelectorAll('[data-nav]')) {
      const active = link.getAttribute('data-nav') === ({ pod: 'pods', card: 'cluster' }[r.name] || r.name);
      if (active) link.setAttribute('aria-current', 'page');
      else link.removeAttribute('aria-current');
    }
    viewEl.replaceChildren(root);
    let heading;
    if (r.name === 'cluster') heading = clusterView(ctx);
    else if (r.name === 'pods') heading = podsView(ctx);
    else if (r.name === 'pod') heading = podView(ctx, r.namespace, r.pod);
    else if (r.name === 'audit') heading = auditView(ctx, r.params);
    else if (r.name === 'card') heading = cardView(ctx, r.node, r.uuid);
    else heading = notFound(ctx);
    const titles = { cluster: 'Cluster', pods: 'Pods', pod: r.pod, card: r.uuid, audit: 'Audit', notfound: 'Not found' };
    document.title = `${titles[r.name]} · gpuslice console`;
    if (focus && heading) heading.focus({ preventScroll: false });
  }

  async function start() {
    document.getElementById('forget-token').addEventListener('click', () => {
      sessionStorage.removeItem(TOKEN_KEY);
      location.reload();
    });
    document.querySelector('[data-skip]').addEventListener('click', (event) => {
      event.preventDefault();
      mainEl.focus();
    });
    window.addEventListener('hashchange', () => route());
    route({ focus: false });
    try {
      const session = await api('api/v1/session');
      // A namespaced viewer's namespaces are found as data is shown: an empty list is not "none".
      const scope = Array.isArray(session.namespaces)
        ? ` (${session.namespaces.length ? session.namespaces.join(', ') : 'namespaced view'})`
        : '';
      viewerEl.textContent = `${session.user ?? 'unknown'}${scope}`;
      viewerEl.title = session.auth === 'tokenreview' ? 'Authenticated with a bearer token' : 'No authentication: reached through a port-forward';
      if (session.auth === 'tokenreview') document.getElementById('forget-token').hidden = false;
    } catch (err) {
      viewerEl.textContent = 'unknown';
      showAlert(`Cannot reach the console API: ${err.message}`);
    }
  }

  start();
})();
