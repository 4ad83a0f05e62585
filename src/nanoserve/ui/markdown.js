// A small markdown renderer for model answers: code blocks, inline code, bold, italics,
// headings, lists, links and paragraphs. Every piece of the answer's text is HTML-escaped
// before any markup is added, and the only markup added is fixed tags (and http(s) links,
// their address escaped): a model's output can never become a script or an attribute.
"use strict";

function escapeHtml(text) {
  return text.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
    .replace(/"/g, "&quot;").replace(/'/g, "&#39;");
}

// Inline markup of one escaped line: code spans first, so that their insides stay literal.
function renderInline(escaped) {
  const parts = escaped.split(/(`[^`]+`)/);
  return parts.map((part, i) => {
    if (i % 2 === 1) return "<code>" + part.slice(1, -1) + "</code>";
    return part
      .replace(/\*\*([^*]+)\*\*/g, "<strong>$1</strong>")
      .replace(/(^|[^*])\*([^*\s][^*]*)\*/g, "$1<em>$2</em>")
      .replace(/\[([^\]]+)\]\((https?:\/\/[^\s()]+)\)/g,
               '<a href="$2" target="_blank" rel="noopener noreferrer">$1</a>');
  }).join("");
}

function renderMarkdown(text) {
  const out = [];
  const lines = text.split("\n");
  let paragraph = [];
  let list = null; // "ul" | "ol"
  const flush = () => {
    if (paragraph.length) out.push("<p>" + paragraph.map(renderInline).join("<br>") + "</p>");
    paragraph = [];
    if (list) out.push("</" + list + ">");
    list = null;
  };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = line.match(/^\s*```\s*([\w+-]*)\s*$/);
    if (fence) { // a code block runs to the closing fence, or to the end of an answer cut short
      flush();
      const code = [];
      for (i++; i < lines.length && !/^\s*```\s*$/.test(lines[i]); i++) code.push(lines[i]);
      const lang = fence[1] ? ' data-lang="' + escapeHtml(fence[1]) + '"' : "";
      out.push("<pre" + lang + "><code>" + escapeHtml(code.join("\n")) + "</code></pre>");
      continue;
    }
    const escaped = escapeHtml(line);
    const heading = escaped.match(/^(#{1,6})\s+(.*)$/);
    const bullet = escaped.match(/^\s*[-*+]\s+(.*)$/);
    const numbered = escaped.match(/^\s*\d+[.)]\s+(.*)$/);
    if (heading) {
      flush();
      const level = Math.min(heading[1].length + 2, 6); // h3..h6 inside a message
      out.push("<h" + level + ">" + renderInline(heading[2]) + "</h" + level + ">");
    } else if (bullet || numbered) {
      const kind = bullet ? "ul" : "ol";
      if (paragraph.length || (list && list !== kind)) flush();
      if (!list) { out.push("<" + kind + ">"); list = kind; }
      out.push("<li>" + renderInline((bullet || numbered)[1]) + "</li>");
    } else if (!line.trim()) {
      flush();
    } else {
      if (list) flush();
      paragraph.push(escaped);
    }
  }
  flush();
  return out.join("");
}

if (typeof module !== "undefined") module.exports = { escapeHtml, renderMarkdown };
