// cllm's chat page: streams /v1/chat/completions, keeps the conversation in this tab.
//
// Safety rule of this file: text from the model, the user or the server (model names) only ever reaches the page through
// textContent / createTextNode (and a link's href after URL parsing allows http(s) only). Nothing
// here assigns innerHTML, outerHTML, insertAdjacentHTML or document.write; the server's
// Content-Security-Policy forbids inline script as a second line of defence. Images: an <img> only ever gets a
// data:image/ URL the page made from the person's own file (FileReader) or stored itself (checked on restore).
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const el = (tag, cls) => { const node = document.createElement(tag); if (cls) node.className = cls; return node; };
  const KEY_STORE = "cllm.apiKey";          // sessionStorage: the key is forgotten with the tab
  const CHAT_STORE = "cllm.chat.messages";  // sessionStorage: the conversation survives a reload
  const SETTINGS_STORE = "cllm.chat.settings";  // localStorage: sampling settings and system prompt
  const MODEL_STORE = "cllm.chat.model";    // sessionStorage: the model chosen in this tab
  const SETTING_IDS = ["system-prompt", "temperature", "top-p", "top-k", "min-p", "repetition-penalty",
    "max-tokens", "seed", "extra"];

  const state = {
    messages: [],          // [{role, content, model?}] without the system prompt; model: who wrote a reply
    model: null,           // the chosen model's name (GET /v1/models), sent as each request's `model`
    models: [],            // [{id, status}]: one per served model, aliases left out (GET /v1/models)
    apiKey: sessionStorage.getItem(KEY_STORE) || "",
    controller: null,      // AbortController of the reply in flight
    generation: 0,         // bumped by New chat: a reply still ending belongs to the old conversation
    attachments: [],       // [{url: data URL (null while being read), name}]: images going with the next message
    reading: new Set(),    // promises of the files still being read (a send waits for them)
  };

  // ------------------------------------------------------------------ markdown (DOM only)
  const INLINE = new RegExp([
    "(`+)([^`]|[^`][\\s\\S]*?[^`])\\1(?!`)",            // 1,2: `code`
    "\\*\\*(?=\\S)([\\s\\S]*?\\S)\\*\\*",                 // 3: **bold**
    "(?<![\\w*])\\*(?=\\S)([^*]*?\\S)\\*(?![\\w*])",        // 4: *italic*
    "(?<!\\w)_(?=\\S)([^_]*?\\S)_(?!\\w)",                 // 5: _italic_
    "\\[([^\\]\\n]+)\\]\\(([^)\\s]+)\\)",                  // 6,7: [text](url)
    "(https?:\\/\\/[^\\s<>()\"']+[^\\s<>()\"'.,;:!?])",    // 8: bare URL
  ].join("|"), "g");

  function appendLink(parent, label, href) {
    let url = null;
    try { url = new URL(href); } catch (_) { url = null; }
    if (!url || (url.protocol !== "http:" && url.protocol !== "https:")) {
      parent.append(document.createTextNode(label === href ? href : `[${label}](${href})`));
      return;
    }
    const a = el("a");
    a.href = url.href;
    a.target = "_blank";
    a.rel = "noopener noreferrer nofollow";
    a.textContent = label;
    parent.append(a);
  }

  function renderInline(text, parent) {
    let last = 0;
    for (const m of text.matchAll(INLINE)) {
      if (m.index > last) parent.append(document.createTextNode(text.slice(last, m.index)));
      if (m[1] !== undefined) {
        const code = el("code"); code.textContent = m[2]; parent.append(code);
      } else if (m[3] !== undefined) {
        const strong = el("strong"); renderInline(m[3], strong); parent.append(strong);
      } else if (m[4] !== undefined || m[5] !== undefined) {
        const em = el("em"); renderInline(m[4] ?? m[5], em); parent.append(em);
      } else if (m[6] !== undefined) {
        appendLink(parent, m[6], m[7]);
      } else {
        appendLink(parent, m[8], m[8]);
      }
      last = m.index + m[0].length;
    }
    if (last < text.length) parent.append(document.createTextNode(text.slice(last)));
  }

  const FENCE = /^\s{0,3}(`{3,}|~{3,})\s*([\w+#.-]*)\s*$/;
  const HEADING = /^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
  const RULE = /^\s{0,3}([-*_])(\s*\1){2,}\s*$/;
  const QUOTE = /^\s{0,3}>\s?/;
  const ITEM = /^\s{0,3}([-*+]|\d{1,9}[.)])\s+/;
  const BLANK = /^\s*$/;
  const startsBlock = (line) => FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || ITEM.test(line);

  // Markdown -> DOM nodes under root. A tolerant subset: fenced code, headings, rules, quotes, lists,
  // paragraphs; inline code, bold, italic, http(s) links. Unfinished constructs (mid-stream) render
  // as far as they go. Anything else, HTML included, is text.
  function renderMarkdown(text, root) {
    const lines = text.split("\n");
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if ((m = line.match(FENCE))) {
        const body = [];
        for (i++; i < lines.length && !lines[i].trim().startsWith(m[1]); i++) body.push(lines[i]);
        i++;
        const pre = el("pre"); const code = el("code");
        if (m[2]) code.dataset.lang = m[2];
        code.textContent = body.join("\n");
        pre.append(code); root.append(pre);
      } else if (BLANK.test(line)) {
        i++;
      } else if ((m = line.match(HEADING))) {
        const h = el(`h${Math.min(m[1].length + 2, 6)}`); renderInline(m[2], h); root.append(h); i++;
      } else if (RULE.test(line)) {
        root.append(el("hr")); i++;
      } else if (QUOTE.test(line)) {
        const inner = [];
        for (; i < lines.length && QUOTE.test(lines[i]); i++) inner.push(lines[i].replace(QUOTE, ""));
        const quote = el("blockquote"); renderMarkdown(inner.join("\n"), quote); root.append(quote);
      } else if ((m = line.match(ITEM))) {
        const ordered = /\d/.test(m[1]);
        const list = el(ordered ? "ol" : "ul");
        if (ordered && parseInt(m[1], 10) !== 1) list.start = parseInt(m[1], 10);
        for (; i < lines.length; i++) {
          const item = lines[i].match(ITEM);
          if (item && /\d/.test(item[1]) === ordered) {
            const li = el("li"); renderInline(lines[i].slice(item[0].length), li); list.append(li);
          } else if (!BLANK.test(lines[i]) && !startsBlock(lines[i]) && list.lastChild) {
            list.lastChild.append(document.createTextNode(" ")); renderInline(lines[i].trim(), list.lastChild);
          } else break;
        }
        root.append(list);
      } else {
        const p = el("p");
        renderInline(line, p);
        for (i++; i < lines.length && !BLANK.test(lines[i]) && !startsBlock(lines[i]); i++) {
          p.append(el("br")); renderInline(lines[i], p);
        }
        root.append(p);
      }
    }
  }

  // ------------------------------------------------------------------ messages on the page
  function messageView(role, content, model) {
    const box = el("div", `msg ${role}`);
    const who = el("div", "role"); who.textContent = role === "user" ? "you" : (model || "assistant");
    const body = el("div", "body");
    const meta = el("div", "meta");
    box.append(who, body, meta);
    box.dataset.state = "done";
    setContent(box, role, content);
    $("messages").append(box);
    $("empty-hint").hidden = true;
    return box;
  }

  function setContent(box, role, content) {
    const body = box.querySelector(".body");
    body.replaceChildren();
    if (role === "user" && Array.isArray(content)) {  // text and image parts: the text, then the images
      const images = el("div", "images");
      for (const part of content) {
        if (part.type === "text") body.append(document.createTextNode(part.text));
        else if (part.type === "image_url") images.append(thumbnail(part.image_url.url));
      }
      if (images.childNodes.length) body.append(images);
    } else if (role === "user") body.textContent = content;  // the user's own text, shown as typed
    else renderMarkdown(content, body);
  }

  function thumbnail(url, name) {
    const img = el("img", "thumb"); img.src = url; img.alt = name || "image";  // a data: URL (CSP: img-src data:)
    if (name) img.title = name;
    return img;
  }

  // ------------------------------------------------------------------ images for the next message
  // Pasted, dropped or picked files, checked here (type, size) before they are read; each goes with the next
  // message as an OpenAI image_url part holding a data: URL. The server checks the bytes again (format, limits).
  const IMAGE_TYPES = ["image/png", "image/jpeg", "image/webp", "image/gif"];
  const MAX_IMAGE_BYTES = 20 * 1024 * 1024;  // the server's max_image_bytes default

  // Why a file is refused, or null.
  function refusal(file) {
    const name = file.name || "that file";
    if (!IMAGE_TYPES.includes(file.type)) return `${name}: not a PNG, JPEG, WebP or GIF image`;
    if (file.size > MAX_IMAGE_BYTES) return `${name}: larger than 20 MB`;
    return null;
  }

  function readDataURL(file) {
    return new Promise((resolve, reject) => {
      const reader = new FileReader();
      reader.onload = () => resolve(String(reader.result));
      reader.onerror = () => reject(reader.error);
      reader.readAsDataURL(file);
    });
  }

  // Attach files, in the order given even if a later one is read first; the refused ones are named under the composer.
  function addImages(files) {
    const errors = [];
    const showErrors = () => { $("attach-error").textContent = errors.join(" · "); };
    for (const file of files) {
      if (!file) continue;
      const why = refusal(file);
      if (why) { errors.push(why); continue; }
      const entry = { url: null, name: file.name || "pasted image" };
      state.attachments.push(entry);  // its place is kept while it is read
      const read = readDataURL(file).then((url) => { entry.url = url; }, () => {
        state.attachments = state.attachments.filter((a) => a !== entry);
        errors.push(`${entry.name}: could not be read`);
        showErrors();
      }).finally(() => { state.reading.delete(read); showAttachments(); });
      state.reading.add(read);
    }
    showErrors();
  }

  function showAttachments() {
    const box = $("attachments");
    box.replaceChildren();
    for (const a of state.attachments) {
      if (a.url === null) continue;
      const item = el("span", "attachment");
      const remove = el("button", "remove"); remove.type = "button"; remove.textContent = "×";
      remove.title = `remove ${a.name}`;
      remove.setAttribute("aria-label", `remove ${a.name}`);
      remove.addEventListener("click", () => {
        state.attachments = state.attachments.filter((x) => x !== a);
        showAttachments();
      });
      item.append(thumbnail(a.url, a.name), remove);
      box.append(item);
    }
  }

  const isImagePart = (p) => p && p.type === "image_url" && p.image_url && typeof p.image_url.url === "string"
    && p.image_url.url.startsWith("data:image/");
  const isPart = (p) => (p && p.type === "text" && typeof p.text === "string") || isImagePart(p);
  const holdsImages = (messages) => messages.some((m) => Array.isArray(m.content) && m.content.some(isImagePart));
  const IMAGE_SIZE_HINT = " (the images go inside the request, whole conversation included: a server started with a"
    + " larger --set max_body_bytes=N takes them)";

  function scrollToEnd() { const main = document.querySelector("main"); main.scrollTop = main.scrollHeight; }

  // The conversation into the tab's storage. Images past its quota (a few MB) are stored as a note instead,
  // largest first: this tab still sends them; after a reload the conversation goes on without them.
  function saveChat() {
    const store = (messages) => {
      try { sessionStorage.setItem(CHAT_STORE, JSON.stringify(messages)); return true; } catch (_) { return false; }
    };
    if (store(state.messages)) return;
    const note = { type: "text", text: "\n[image not kept across a reload: too large for the tab's storage]" };
    const lean = state.messages.map((m) => (Array.isArray(m.content) ? { ...m, content: [...m.content] } : m));
    const images = [];  // [message, part, size]
    lean.forEach((m, i) => {
      if (Array.isArray(m.content)) m.content.forEach((p, j) => { if (isImagePart(p)) images.push([i, j, p.image_url.url.length]); });
    });
    images.sort((a, b) => b[2] - a[2]);
    for (const [i, j] of images) {
      lean[i].content[j] = note;
      if (store(lean)) return;
    }
    sessionStorage.removeItem(CHAT_STORE);  // better no stored conversation than a stale one
  }

  function restoreChat() {
    try { state.messages = JSON.parse(sessionStorage.getItem(CHAT_STORE) || "[]"); } catch (_) { state.messages = []; }
    if (!Array.isArray(state.messages)) state.messages = [];
    state.messages = state.messages.filter((m) => m && (m.role === "user" || m.role === "assistant")
      && (typeof m.content === "string" || (m.role === "user" && Array.isArray(m.content) && m.content.every(isPart))));
    for (const m of state.messages) messageView(m.role, m.content, typeof m.model === "string" ? m.model : null);
    scrollToEnd();
  }

  // ------------------------------------------------------------------ settings
  function saveSettings() {
    const values = {};
    for (const id of SETTING_IDS) values[id] = $(id).value;
    localStorage.setItem(SETTINGS_STORE, JSON.stringify(values));
  }

  function restoreSettings() {
    let values = {};
    try { values = JSON.parse(localStorage.getItem(SETTINGS_STORE) || "{}") || {}; } catch (_) { values = {}; }
    for (const id of SETTING_IDS) if (typeof values[id] === "string") $(id).value = values[id];
  }

  function numberSetting(id, parse) {
    const raw = $(id).value.trim();
    if (raw === "") return undefined;
    const value = parse(raw);
    return Number.isFinite(value) ? value : undefined;
  }

  // The request body, or throws Error with a message for the person.
  function buildRequest() {
    const system = $("system-prompt").value.trim();
    const turns = state.messages.map((m) => ({ role: m.role, content: m.content }));  // without the page's notes
    const messages = (system ? [{ role: "system", content: system }] : []).concat(turns);
    const body = { messages, stream: true, stream_options: { include_usage: true } };
    if (state.model) body.model = state.model;
    const fields = {
      temperature: numberSetting("temperature", parseFloat),
      top_p: numberSetting("top-p", parseFloat),
      top_k: numberSetting("top-k", (s) => parseInt(s, 10)),
      min_p: numberSetting("min-p", parseFloat),
      repetition_penalty: numberSetting("repetition-penalty", parseFloat),
      max_tokens: numberSetting("max-tokens", (s) => parseInt(s, 10)),
      seed: numberSetting("seed", (s) => parseInt(s, 10)),
    };
    for (const [k, v] of Object.entries(fields)) if (v !== undefined) body[k] = v;
    const extra = $("extra").value.trim();
    $("extra-error").textContent = "";
    if (extra) {
      let parsed;
      try { parsed = JSON.parse(extra); } catch (err) { throw new Error(`Extra request fields: not JSON (${err.message})`); }
      if (!parsed || typeof parsed !== "object" || Array.isArray(parsed)) throw new Error("Extra request fields: must be a JSON object");
      Object.assign(body, parsed);
    }
    return body;
  }

  // ------------------------------------------------------------------ HTTP
  function headers() {
    const h = { "Content-Type": "application/json" };
    if (state.apiKey) h.Authorization = `Bearer ${state.apiKey}`;
    return h;
  }

  // The server's own words for a failed response (an OpenAI-style error body), with its Retry-After.
  async function errorMessage(res) {
    let message = `HTTP ${res.status}`;
    try {
      const body = await res.json();
      if (body && body.error && body.error.message) message = `${res.status}: ${String(body.error.message)}`;
    } catch (_) { /* not JSON */ }
    const retry = (res.headers.get("Retry-After") || "").trim();
    if (/^\d{1,6}$/.test(retry)) message += ` (retry in ${retry} s)`;
    return message;
  }

  // fetch, with a network failure said plainly (an abort stays an AbortError).
  async function request(url, options) {
    try {
      return await fetch(url, options);
    } catch (err) {
      if (err.name === "AbortError") throw err;
      throw new Error("the server could not be reached");
    }
  }

  // Server-sent events of one response: yields each data object; returns at [DONE].
  async function* events(res) {
    const reader = res.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      let chunk;
      try {
        chunk = await reader.read();
      } catch (err) {
        if (err.name === "AbortError") throw err;
        throw new Error("the connection to the server was lost");
      }
      const { value, done } = chunk;
      if (done) return;
      buffer += decoder.decode(value, { stream: true });
      let nl;
      while ((nl = buffer.indexOf("\n")) >= 0) {
        const line = buffer.slice(0, nl).replace(/\r$/, "");
        buffer = buffer.slice(nl + 1);
        if (!line.startsWith("data:")) continue;  // blank separators, ": keep-alive" comments
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        let event;
        try { event = JSON.parse(data); } catch (_) { throw new Error("the server sent a malformed event"); }
        yield event;
      }
    }
  }

  function askForKey(message) {
    $("api-key-panel").hidden = false;
    $("api-key-error").textContent = message || "";
    $("api-key").focus();
  }

  // ------------------------------------------------------------------ models
  // GET v1/models has a card per name a request may use; an alias's card has root != id and is no entry of
  // its own. A server without root/status fields (an older one) serves one model: its first card, loaded.
  function modelsOf(cards) {
    if (!Array.isArray(cards)) return [];
    let named = cards.filter((c) => c && typeof c.id === "string" && c.id);
    if (!named.some((c) => typeof c.root === "string")) named = named.slice(0, 1);
    const models = [];
    for (const c of named) {
      const root = typeof c.root === "string" && c.root ? c.root : c.id;
      if (root !== c.id || models.some((m) => m.id === c.id)) continue;
      const status = typeof c.status === "string" ? c.status : (c.loaded === false ? "unloaded" : "loaded");
      models.push({ id: c.id, status });
    }
    return models.length ? models : named.slice(0, 1).map((c) => ({ id: c.id, status: "loaded" }));
  }

  const STATUS_NOTES = new Map([["loaded", ""], ["loading", "loading…"], ["unloaded", "not loaded"],
    ["unloading", "unloading"], ["failed", "failed to load"]]);

  function optionLabel(m) {
    const note = STATUS_NOTES.has(m.status) ? STATUS_NOTES.get(m.status) : m.status;
    return note ? `${m.id} (${note})` : m.id;
  }

  function showBadge(text) {
    $("model-name").textContent = text;
    $("model-name").hidden = false;
    $("model-picker").hidden = true;
  }

  // The served models into the header: the badge for one model, the picker for several (its options built
  // with option.text only). Keeps the chosen model while it is served; else the tab's stored one, else the first.
  function showModels(models) {
    state.models = models;
    if (!models.some((m) => m.id === state.model)) {
      const stored = sessionStorage.getItem(MODEL_STORE);
      state.model = (models.find((m) => m.id === stored) || models[0] || { id: null }).id;
    }
    const picker = $("model-picker");
    const same = picker.options.length === models.length && models.every((m, i) => picker.options[i].value === m.id);
    if (!same) {
      picker.replaceChildren(...models.map((m) => { const option = el("option"); option.value = m.id; return option; }));
    }
    models.forEach((m, i) => {
      const label = optionLabel(m);
      if (picker.options[i].text !== label) picker.options[i].text = label;  // text only, never markup
    });
    if (state.model !== null) picker.value = state.model;
    showBadge(state.model || "(no model)");
    if (models.length > 1) { $("model-name").hidden = true; picker.hidden = false; }
  }

  function modelEntry(id) { return state.models.find((m) => m.id === id) || null; }

  // GET v1/models: {models} or {status, message}.
  async function getModels() {
    let res;
    try {
      res = await request("v1/models", { headers: headers() });
    } catch (err) {
      return { status: 0, message: err.message };
    }
    if (!res.ok) return { status: res.status, message: await errorMessage(res) };
    try {
      return { models: modelsOf((await res.json()).data) };
    } catch (_) {
      return { status: res.status, message: "unreadable model list" };
    }
  }

  // The models' statuses again (the picker's notes); a failure keeps what the page showed.
  async function refreshModels() {
    const got = await getModels();
    if (got.models && got.models.length) showModels(got.models);
  }

  async function loadModel() {
    const status = $("server-status");
    for (;;) {
      let health = null;
      try { health = await fetch("health"); } catch (_) { health = null; }
      if (health && health.ok) break;
      let phase = "unreachable";
      if (health) { try { phase = (await health.json()).status || phase; } catch (_) { /* keep */ } }
      status.textContent = phase === "loading" ? "model loading…" : `server: ${phase}`;
      await new Promise((r) => setTimeout(r, 1000));
    }
    status.textContent = "";
    const got = await getModels();
    if (got.status === 401) {
      showBadge("API key needed");
      askForKey(state.apiKey ? "That key was refused." : "");
      return false;
    }
    if (!got.models) { showBadge(got.message); return false; }
    showModels(got.models);
    $("api-key-panel").hidden = true;
    $("forget-key").hidden = !state.apiKey;
    return true;
  }

  // While a reply waits for its first token: "loading MODEL…" in the header whenever the model is not loaded,
  // as last seen, then as GET v1/models says each second (until it says loaded). Returns the function that
  // ends the watch (and clears what it showed).
  function watchLoading(model) {
    const status = $("server-status");
    let over = false; let shown = false; let timer = null;
    const show = (loading) => {
      if (loading) {
        status.textContent = `loading ${model}…`;
        status.classList.add("loading");
        shown = true;
      } else if (shown) {
        status.textContent = "";
        status.classList.remove("loading");
        shown = false;
      }
    };
    const notLoaded = () => { const m = modelEntry(model); return m !== null && m.status !== "loaded"; };
    const tick = async () => {
      timer = null;
      await refreshModels();
      if (over) return;
      const loading = notLoaded();
      show(loading);
      if (loading) timer = setTimeout(tick, 1000);
    };
    show(notLoaded());
    timer = setTimeout(tick, 1000);
    return () => {
      if (over) return;
      over = true;
      if (timer !== null) clearTimeout(timer);
      show(false);
    };
  }

  // ------------------------------------------------------------------ one reply
  function setBusy(busy) {
    $("send").hidden = busy;
    $("stop").hidden = !busy;
  }

  function formatStats(s) {
    const parts = [];
    if (s.ttft !== null) parts.push(`TTFT ${Math.round(s.ttft)} ms`);
    if (s.rate !== null) parts.push(`${s.rate.toFixed(1)} tok/s`);
    parts.push(`${s.exact ? "" : "~"}${s.tokens} tokens`);
    parts.push(s.finish);
    return parts.join(" · ");
  }

  async function send(text) {
    if (state.controller) return;
    let body;
    const attached = state.attachments.filter((a) => a.url !== null);
    const images = attached.map((a) => ({ type: "image_url", image_url: { url: a.url } }));
    const content = images.length ? [...(text ? [{ type: "text", text }] : []), ...images] : text;
    state.messages.push({ role: "user", content });
    try {
      body = buildRequest();
    } catch (err) {
      state.messages.pop();
      $("extra-error").textContent = err.message;
      $("settings").hidden = false;
      return;
    }
    $("input").value = "";
    state.attachments = []; showAttachments(); $("attach-error").textContent = "";
    messageView("user", content);
    saveChat();
    const generation = state.generation;
    const userMessage = state.messages[state.messages.length - 1];
    const model = typeof body.model === "string" ? body.model : null;  // the extra fields may name one
    const reply = { role: "assistant", content: "" };
    if (model) reply.model = model;
    const view = messageView("assistant", "", model);
    view.dataset.state = "streaming";
    scrollToEnd();

    const controller = new AbortController();
    state.controller = controller;
    setBusy(true);
    const started = performance.now();
    const endWatch = model ? watchLoading(model) : () => {};
    let first = null; let chunks = 0; let usage = null; let finish = null; let pending = false;
    const redraw = () => {
      pending = false;
      setContent(view, "assistant", reply.content);
      scrollToEnd();
    };
    try {
      const res = await request("v1/chat/completions", {
        method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
      });
      if (res.status === 401) { askForKey("The server asks for an API key."); throw new Error("API key needed"); }
      if (!res.ok) throw new Error(await errorMessage(res) + (res.status === 413 && holdsImages(body.messages) ? IMAGE_SIZE_HINT : ""));
      for await (const event of events(res)) {
        if (event.error) throw new Error(event.error.message || "server error");
        if (event.usage) usage = event.usage;
        for (const choice of event.choices || []) {
          const delta = choice.delta && choice.delta.content;
          if (delta) {
            if (first === null) { first = performance.now(); endWatch(); }
            chunks++;
            reply.content += delta;
            if (!pending) { pending = true; requestAnimationFrame(redraw); }
          }
          if (choice.finish_reason) finish = choice.finish_reason;
        }
      }
      view.dataset.state = "done";
    } catch (err) {
      if (err.name === "AbortError") {
        view.dataset.state = "stopped";
        finish = "stopped";
      } else {
        view.dataset.state = "error";
        finish = "error";
        const note = el("div", "error-text"); note.textContent = err.message;
        view.querySelector(".meta").before(note);
      }
    } finally {
      endWatch();
      state.controller = null;
      setBusy(false);
    }
    if (state.models.length > 1) refreshModels();  // the picker's notes: this model is loaded now, others maybe not
    redraw();
    const ended = performance.now();
    const tokens = usage ? usage.completion_tokens : chunks;
    const decodeS = first !== null ? (ended - first) / 1000 : 0;
    const stats = {
      ttft: first !== null ? first - started : null,
      rate: tokens > 1 && decodeS > 0 ? (tokens - 1) / decodeS : null,
      tokens, exact: usage !== null, finish: finish || "done",
    };
    const line = formatStats(stats);
    view.querySelector(".meta").textContent = line;
    $("stats").textContent = line;
    if (generation !== state.generation) return;  // New chat was pressed meanwhile
    if (reply.content) {
      state.messages.push(reply);
    } else if (finish === "error" && state.messages[state.messages.length - 1] === userMessage) {
      state.messages.pop();  // nothing came back: the next request should not carry this message twice
      if (!state.attachments.length && attached.length) {  // its images back in the composer, to resend or remove
        state.attachments = attached; showAttachments();
      }
    }
    saveChat();
    $("input").focus();
  }

  // ------------------------------------------------------------------ wiring
  function wire() {
    $("composer").addEventListener("submit", async (ev) => {
      ev.preventDefault();
      await Promise.all(state.reading);  // images still being read go with this message
      const text = $("input").value.trim();
      if (text || state.attachments.length) send(text);
    });
    $("input").addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) { ev.preventDefault(); $("composer").requestSubmit(); }
    });
    $("stop").addEventListener("click", () => { if (state.controller) state.controller.abort(); });
    $("attach").addEventListener("click", () => $("image-input").click());
    $("image-input").addEventListener("change", () => {
      addImages(Array.from($("image-input").files));
      $("image-input").value = "";  // the same file may be picked again
    });
    // Pasted files are attached; pasted text still goes into the box (a copy with both keeps both).
    $("input").addEventListener("paste", (ev) => {
      const data = ev.clipboardData;
      const files = Array.from(data ? data.items : []).filter((i) => i.kind === "file").map((i) => i.getAsFile());
      if (!files.length) return;
      if (!Array.from(data.types).includes("text/plain")) ev.preventDefault();
      addImages(files);
    });
    // Files dropped anywhere on the page are attached (a browser would otherwise leave the page to show the
    // file); dragged text keeps its usual way into the message box.
    const carriesFiles = (ev) => ev.dataTransfer && Array.from(ev.dataTransfer.types).includes("Files");
    let dragDepth = 0;
    document.addEventListener("dragenter", (ev) => {
      if (carriesFiles(ev)) { dragDepth++; document.body.classList.add("dropping"); }
    });
    document.addEventListener("dragleave", (ev) => {
      if (carriesFiles(ev) && --dragDepth <= 0) { dragDepth = 0; document.body.classList.remove("dropping"); }
    });
    document.addEventListener("dragover", (ev) => { if (carriesFiles(ev)) ev.preventDefault(); });
    document.addEventListener("drop", (ev) => {
      dragDepth = 0; document.body.classList.remove("dropping");
      if (!carriesFiles(ev)) return;
      ev.preventDefault();
      addImages(Array.from(ev.dataTransfer.files));
    });
    $("new-chat").addEventListener("click", () => {
      if (state.controller) state.controller.abort();
      state.generation++;
      state.messages = []; saveChat();
      state.attachments = []; showAttachments(); $("attach-error").textContent = "";
      $("messages").replaceChildren(); $("empty-hint").hidden = false; $("stats").textContent = "";
    });
    $("toggle-settings").addEventListener("click", () => {
      const panel = $("settings"); panel.hidden = !panel.hidden;
      $("toggle-settings").setAttribute("aria-expanded", String(!panel.hidden));
    });
    for (const id of SETTING_IDS) $(id).addEventListener("change", saveSettings);
    $("api-key-form").addEventListener("submit", async (ev) => {
      ev.preventDefault();
      state.apiKey = $("api-key").value.trim();
      sessionStorage.setItem(KEY_STORE, state.apiKey);
      await loadModel();
    });
    $("forget-key").addEventListener("click", () => { state.apiKey = ""; sessionStorage.removeItem(KEY_STORE); loadModel(); });
    // Another model answers from the next request on; the conversation stays (the new model reads it all).
    $("model-picker").addEventListener("change", () => {
      state.model = $("model-picker").value;
      sessionStorage.setItem(MODEL_STORE, state.model);
      $("model-name").textContent = state.model;
    });
    $("model-picker").addEventListener("focus", () => { if (state.models.length > 1) refreshModels(); });
  }

  wire();
  restoreSettings();
  restoreChat();
  loadModel();
  window.cllmChat = { renderMarkdown };  // for tests and the curious; renders into a node you give it
})();
