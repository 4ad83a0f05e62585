// The chat page: a conversation streamed from /v1/chat/completions. Text from the model is
// only ever put on the page through textContent or renderMarkdown (which escapes it).
"use strict";

const $ = (id) => document.getElementById(id);
const KEY = "nanoserve-api-key";
const history = [];   // {role, content} of the conversation so far
let model = null;     // the served model's name, from /v1/models
let controller = null; // the AbortController of the answer streaming now

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = sessionStorage.getItem(KEY);
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

async function connect() {
  const response = await fetch("v1/models", { headers: headers() });
  if (response.status === 401) {
    $("key-form").hidden = false;
    $("key-error").textContent = sessionStorage.getItem(KEY) ? "That key was refused." : "";
    $("model").textContent = "needs an API key";
    return;
  }
  if (!response.ok) throw new Error("GET /v1/models: HTTP " + response.status);
  model = (await response.json()).data[0].id;
  $("key-form").hidden = true;
  $("model").textContent = model;
  $("model").title = model;
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "message " + role;
  div.textContent = text;
  $("messages").appendChild(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

// An assistant message: a folded reasoning block (when the server splits it off), then the
// answer rendered as markdown, redrawn as deltas arrive.
function assistantView() {
  const div = addMessage("assistant", "");
  const details = document.createElement("details");
  details.className = "reasoning";
  details.hidden = true;
  const summary = document.createElement("summary");
  summary.textContent = "Reasoning";
  const thoughts = document.createElement("div");
  details.append(summary, thoughts);
  const body = document.createElement("div");
  body.className = "content";
  div.append(details, body);
  return {
    div,
    show(reasoning, content) {
      if (reasoning) { details.hidden = false; thoughts.textContent = reasoning; }
      body.innerHTML = renderMarkdown(content);
      div.scrollIntoView({ block: "end" });
    },
  };
}

function number(id) {
  const value = parseFloat($(id).value);
  return Number.isFinite(value) ? value : undefined;
}

async function send(text) {
  history.push({ role: "user", content: text });
  addMessage("user", text);
  const system = $("system").value.trim();
  const messages = system ? [{ role: "system", content: system }, ...history] : history;
  const view = assistantView();
  controller = new AbortController();
  setBusy(true);
  let content = "", reasoning = "", tokens = 0, first = null, last = null;
  const sent = performance.now();
  try {
    const response = await fetch("v1/chat/completions", {
      method: "POST", headers: headers(), signal: controller.signal,
      body: JSON.stringify({
        model, messages, stream: true, stream_options: { include_usage: true },
        temperature: number("temperature"), top_p: number("top-p"),
        max_tokens: number("max-tokens"),
      }),
    });
    if (!response.ok) {
      const body = await response.json().catch(() => ({}));
      if (response.status === 401) sessionStorage.removeItem(KEY);
      throw new Error((body.error && body.error.message) || "HTTP " + response.status);
    }
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      const events = buffer.split("\n\n");
      buffer = events.pop();
      for (const event of events) {
        const data = event.replace(/^data: /, "");
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) tokens = chunk.usage.completion_tokens;
        const delta = (chunk.choices && chunk.choices[0] && chunk.choices[0].delta) || {};
        if (delta.content || delta.reasoning_content) {
          content += delta.content || "";
          reasoning += delta.reasoning_content || "";
          last = performance.now();
          if (first === null) first = last;
          view.show(reasoning, content);
        }
      }
    }
  } catch (error) {
    if (error.name !== "AbortError") {
      view.div.classList.add("error");
      view.div.textContent = "Error: " + error.message;
    }
  } finally {
    controller = null;
    setBusy(false);
    if (content) history.push({ role: "assistant", content });
    // Decode speed between the first and last delta; when the stream arrived in one read
    // (no span between them), the whole reply's rate from the moment it was asked for.
    if (first !== null && tokens > 1) {
      const rate = last > first ? (tokens - 1) / (last - first) : tokens / (last - sent);
      if (Number.isFinite(rate)) $("speed").textContent = (rate * 1000).toFixed(1) + " tok/s";
    }
    view.div.dataset.done = "true";
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || controller || !model) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => controller && controller.abort());
$("clear").addEventListener("click", () => {
  if (controller) controller.abort();
  history.length = 0;
  $("messages").replaceChildren();
});
$("settings-toggle").addEventListener("click", () => { $("settings").hidden = !$("settings").hidden; });
$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY, $("key").value);
  connect().catch((error) => { $("model").textContent = error.message; });
});
connect().catch((error) => { $("model").textContent = error.message; });
