// The chat page: a conversation kept in this page, each answer streamed from
// /v1/chat/completions (server-sent events read through fetch), the model list from /v1/models.
// URLs are relative, so the page works under a --root-path prefix too.
"use strict";

const $ = (id) => document.getElementById(id);
const conversation = [];  // {role, content} of each finished turn, sent back with every request
let controller = null;  // the AbortController of the answer streaming now, if any

function headers() {
  const key = $("api-key").value.trim();
  const h = { "Content-Type": "application/json" };
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}

// A failed response's message, from the OpenAI error body when there is one.
async function failure(response) {
  if (response.status === 401) {
    return $("api-key").value.trim()
      ? "401 Unauthorized: the server refused this API key."
      : "401 Unauthorized: this server needs an API key. Enter it under API key.";
  }
  let detail = response.statusText;
  try {
    detail = (await response.json()).error.message;
  } catch (e) { /* not an OpenAI error body: keep the status text */ }
  return `${response.status}: ${detail}`;
}

async function loadModels() {
  const select = $("model");
  let response;
  try {
    response = await fetch("v1/models", { headers: headers() });
  } catch (e) {
    showError(`cannot reach the server: ${e.message}`);
    return;
  }
  if (!response.ok) {
    select.replaceChildren();
    showError(await failure(response));
    return;
  }
  const previous = select.value;
  const { data } = await response.json();
  select.replaceChildren(...data.map((card) => new Option(card.id, card.id)));
  if (data.some((card) => card.id === previous)) select.value = previous;
  showError("");
}

function addMessage(role, text) {
  const box = document.createElement("div");
  box.className = `message ${role}`;
  const label = document.createElement("div");
  label.className = "role";
  label.textContent = role;
  box.append(label);
  if (role === "user") {
    box.append(text);
  } else {
    const thinking = document.createElement("details");
    thinking.hidden = true;  // shown once reasoning arrives; collapsed until opened
    thinking.append(Object.assign(document.createElement("summary"), { textContent: "Reasoning" }),
      document.createElement("div"));
    const content = document.createElement("div");
    content.className = "content";
    box.append(thinking, content);
  }
  $("messages").append(box);
  box.scrollIntoView({ block: "end" });
  return box;
}

// One answer's view: reasoning and content as they grow. `data-raw` holds the content's text
// as the server sent it (the rendered HTML is markdown's reading of it).
function answerView(box) {
  const thinking = box.querySelector("details");
  const content = box.querySelector(".content");
  let reasoning = "";
  let text = "";
  return {
    add(delta) {
      const r = delta.reasoning_content ?? delta.reasoning;
      if (r) {
        reasoning += r;
        thinking.hidden = false;
        thinking.lastChild.textContent = reasoning;
      }
      if (delta.content) {
        text += delta.content;
        content.dataset.raw = text;
        content.innerHTML = renderMarkdown(text);
        box.scrollIntoView({ block: "end" });
      }
    },
    note(message) {
      box.append(Object.assign(document.createElement("div"),
        { className: "note", textContent: message }));
    },
    get text() { return text; },
  };
}

// The server-sent events of `response`, one parsed `data:` payload at a time, until [DONE].
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const payload = line.slice(5).trim();
        if (payload === "[DONE]") return;
        yield JSON.parse(payload);
      }
    }
  }
}

function request(messages) {
  const body = { model: $("model").value, messages, stream: true };
  const system = $("system").value.trim();
  if (system) body.messages = [{ role: "system", content: system }, ...messages];
  const temperature = parseFloat($("temperature").value);
  if (!Number.isNaN(temperature)) body.temperature = temperature;
  const maxTokens = parseInt($("max-tokens").value, 10);
  if (!Number.isNaN(maxTokens)) body.max_tokens = maxTokens;
  return body;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

async function send(prompt) {
  showError("");
  const turn = { role: "user", content: prompt };
  addMessage("user", prompt);
  const view = answerView(addMessage("assistant"));
  controller = new AbortController();
  setBusy(true);
  try {
    const response = await fetch("v1/chat/completions", {
      method: "POST", headers: headers(), signal: controller.signal,
      body: JSON.stringify(request([...conversation, turn])),
    });
    if (!response.ok) throw new Error(await failure(response));
    for await (const chunk of events(response)) {
      if (chunk.error) throw new Error(chunk.error.message);
      const choice = chunk.choices && chunk.choices[0];
      if (choice) view.add(choice.delta || {});
      if (choice && choice.finish_reason === "length") view.note("(stopped at max tokens)");
    }
  } catch (e) {
    if (e.name === "AbortError") view.note("(stopped)");
    else { view.note("(failed)"); showError(e.message); }
  } finally {
    controller = null;
    setBusy(false);
  }
  // The turn stays in the conversation with whatever was answered, even if cut short.
  conversation.push(turn, { role: "assistant", content: view.text });
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const prompt = $("prompt").value.trim();
  if (!prompt || controller) return;
  $("prompt").value = "";
  send(prompt);
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
  conversation.length = 0;
  $("messages").replaceChildren();
});
$("api-key").addEventListener("change", loadModels);
loadModels();
