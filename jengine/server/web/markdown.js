// A small markdown renderer for the model's answers: paragraphs, headings, fenced code, inline
// code, bold, italic, lists and links. The text is HTML-escaped before any markup is added, and
// links keep only http(s) and relative targets, so a model's output cannot inject script.
"use strict";

function escapeHtml(text) {
  return text.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
    .replace(/"/g, "&quot;").replace(/'/g, "&#39;");
}

// Inline markup over escaped text. Code spans are cut out first so that nothing inside them is
// read as emphasis or a link.
function renderInline(escaped) {
  const spans = [];
  let s = escaped.replace(/`([^`]+)`/g, (_, code) => {
    spans.push(`<code>${code}</code>`);
    return `\u0000${spans.length - 1}\u0000`;
  });
  s = s.replace(/\[([^\]]+)\]\(([^)\s]+)\)/g, (whole, label, url) =>
    /^(https?:\/\/|\/|#)/.test(url)
      ? `<a href="${url}" target="_blank" rel="noopener noreferrer">${label}</a>` : whole);
  s = s.replace(/\*\*([^*]+)\*\*/g, "<strong>$1</strong>")
    .replace(/__([^_]+)__/g, "<strong>$1</strong>")
    .replace(/(^|[^*])\*([^*\s][^*]*)\*/g, "$1<em>$2</em>")
    .replace(/(^|[^\w_])_([^_\s][^_]*)_(?!\w)/g, "$1<em>$2</em>");
  return s.replace(/\u0000(\d+)\u0000/g, (_, i) => spans[Number(i)]);
}

const LIST_ITEM = /^\s*([-*+]|\d+[.)])\s+(.*)$/;

// The blocks of text outside code fences: headings, lists, paragraphs (split at blank lines).
function renderBlocks(text) {
  const out = [];
  for (const block of text.split(/\n\s*\n/)) {
    const lines = block.split("\n").filter((line) => line.trim() !== "");
    if (lines.length === 0) continue;
    const heading = /^(#{1,6})\s+(.*)$/.exec(lines[0]);
    if (heading && lines.length === 1) {
      const level = heading[1].length;
      out.push(`<h${level}>${renderInline(escapeHtml(heading[2]))}</h${level}>`);
    } else if (lines.every((line) => LIST_ITEM.test(line))) {
      const tag = /^\s*\d/.test(lines[0]) ? "ol" : "ul";
      const items = lines.map((line) => `<li>${renderInline(escapeHtml(LIST_ITEM.exec(line)[2]))}</li>`);
      out.push(`<${tag}>${items.join("")}</${tag}>`);
    } else {
      out.push(`<p>${lines.map((line) => renderInline(escapeHtml(line))).join("<br>")}</p>`);
    }
  }
  return out.join("");
}

// Markdown text -> HTML. An unclosed fence (an answer still streaming) renders as code so far.
function renderMarkdown(text) {
  const out = [];
  const fence = /^```([\w+-]*)[^\n]*\n([\s\S]*?)(?:^```[ \t]*$|(?![\s\S]))/gm;
  let last = 0;
  for (const match of text.matchAll(fence)) {
    out.push(renderBlocks(text.slice(last, match.index)));
    const lang = match[1] ? ` class="language-${escapeHtml(match[1])}"` : "";
    out.push(`<pre><code${lang}>${escapeHtml(match[2].replace(/\n$/, ""))}</code></pre>`);
    last = match.index + match[0].length;
  }
  out.push(renderBlocks(text.slice(last)));
  return out.join("");
}
