// Text for the self-contained HTML pages mpusim writes (the layout page, the trace page).
#pragma once

#include <string>
#include <string_view>

namespace mpusim {

// Text safe inside an HTML element or a quoted attribute.
inline std::string HtmlEscape(std::string_view text) {
  std::string html;
  html.reserve(text.size());
  for (const char ch : text) {
    switch (ch) {
      case '<':
        html += "&lt;";
        break;
      case '>':
        html += "&gt;";
        break;
      case '&':
        html += "&amp;";
        break;
      case '"':
        html += "&quot;";
        break;
      default:
        html += ch;
    }
  }
  return html;
}

// JSON text safe inside <script type="application/json">: "</" must not appear there, and in
// JSON '<' can only occur inside strings, where \u003c is the same character.
inline std::string JsonForScript(std::string_view json) {
  std::string out;
  out.reserve(json.size());
  for (const char ch : json) {
    if (ch == '<') {
      out += "\\u003c";
    } else {
      out += ch;
    }
  }
  return out;
}

}  // namespace mpusim
