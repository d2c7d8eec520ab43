// Inline maths stays with the punctuation that touches it. A browser may break a line between an
// opening parenthesis and the formula after it, or between a formula and the comma after it:
// on a phone's narrow column that leaves "tokens (" at the end of one line and "B = 2)" at the
// start of the next. After MathJax has typeset the page, each inline formula is wrapped with the
// characters written against it (no space between) in a span that does not break.
(function () {
  "use strict";
  var GLUE = "math-glue";

  function splitTail(node) {  // the text node's last run of non-space characters, split off
    var m = /\S+$/.exec(node.data);
    return m ? node.splitText(m.index) : null;
  }

  function splitHead(node) {  // the text node's first run of non-space characters, split off
    var m = /^\S+/.exec(node.data);
    if (!m) return null;
    if (m[0].length < node.data.length) node.splitText(m[0].length);
    return node;
  }

  function glue(container) {
    // Sphinx writes inline maths as <span class="math">\(...\)</span>; MathJax typesets it inside
    var math = container.closest("span.math") || container;
    if (math.parentNode.classList && math.parentNode.classList.contains(GLUE)) return;
    var before = math.previousSibling, after = math.nextSibling;
    var head = before && before.nodeType === Node.TEXT_NODE ? splitTail(before) : null;
    var tail = after && after.nodeType === Node.TEXT_NODE ? splitHead(after) : null;
    if (!head && !tail) return;
    var span = document.createElement("span");
    span.className = GLUE;
    math.parentNode.insertBefore(span, head || math);
    if (head) span.appendChild(head);
    span.appendChild(math);
    if (tail) span.appendChild(tail);
  }

  function glueAll() {
    document.querySelectorAll(".bd-article mjx-container:not([display='true'])").forEach(glue);
    document.documentElement.dataset.mathGlued = "1";
  }

  function start() {
    var mj = window.MathJax;
    if (mj && mj.startup && mj.startup.promise) {
      mj.startup.promise.then(glueAll);
    } else {
      glueAll();
    }
  }
  window.addEventListener("load", start);
})();
