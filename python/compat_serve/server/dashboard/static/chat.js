// compat-serve dashboard, its chat: streams /v1/chat/completions with the key and the
// model dashboard.js holds (`app`), and draws the reply as it comes. Loaded after
// dashboard.js (both deferred), whose helpers it uses: $, authHeaders, errorMessage.
"use strict";

function chatBubble(role, text) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  div.textContent = text;
  $("chat-log").appendChild(div);
  return div;
}

function scrollChat() {
  const log = $("chat-log");
  log.scrollTop = log.scrollHeight;
}

async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart())
        .join("\n");
      if (data && data !== "[DONE]") onEvent(JSON.parse(data));
    }
  }
}

async function sendChat(text) {
  app.chat.push({ role: "user", content: text });
  chatBubble("user", text);
  const bubble = chatBubble("assistant", "");
  bubble.dataset.state = "streaming";
  const reasoning = document.createElement("span");
  reasoning.className = "reasoning";
  const content = document.createElement("span");
  content.className = "content";
  bubble.append(reasoning, content);
  scrollChat();
  app.chatAbort = new AbortController();
  $("chat-send").disabled = true;
  $("chat-stop").disabled = false;
  let usage = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: authHeaders({ "content-type": "application/json", "x-client-name": "dashboard" }),
      body: JSON.stringify({
        model: app.model,
        messages: app.chat,
        stream: true,
        stream_options: { include_usage: true },
        max_tokens: Math.max(1, Number($("chat-max-tokens").value) || 512),
      }),
      signal: app.chatAbort.signal,
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    await readEvents(response, (event) => {
      if (event.error) throw new Error(event.error.message || "stream error");
      if (event.usage) usage = event.usage;
      for (const choice of event.choices || []) {
        const delta = choice.delta || {};
        if (delta.reasoning_content) reasoning.textContent += delta.reasoning_content;
        if (delta.content) content.textContent += delta.content;
      }
      scrollChat();
    });
    app.chat.push({ role: "assistant", content: content.textContent });
  } catch (error) {
    if (error.name !== "AbortError") {
      bubble.classList.add("error");
      content.textContent += `${content.textContent ? "\n" : ""}[${error.message}]`;
    }
    if (content.textContent) app.chat.push({ role: "assistant", content: content.textContent });
  } finally {
    if (usage) {
      const line = document.createElement("span");
      line.className = "usage";
      const cached = (usage.prompt_tokens_details || {}).cached_tokens || 0;
      line.textContent = `${usage.prompt_tokens} prompt tokens (${cached} from cache), ${usage.completion_tokens} generated`;
      bubble.appendChild(line);
    }
    bubble.dataset.state = "done";
    app.chatAbort = null;
    $("chat-send").disabled = false;
    $("chat-stop").disabled = true;
    scrollChat();
  }
}

$("chat-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("chat-input").value.trim();
  if (!text || app.chatAbort) return;
  $("chat-input").value = "";
  sendChat(text);
});
$("chat-input").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("chat-form").requestSubmit();
  }
});
$("chat-stop").addEventListener("click", () => app.chatAbort && app.chatAbort.abort());
$("chat-clear").addEventListener("click", () => {
  if (app.chatAbort) app.chatAbort.abort();
  app.chat = [];
  $("chat-log").replaceChildren();
});
