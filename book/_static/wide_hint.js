// On a phone, a printed output, a table or a block of code wider than the text column scrolls
// sideways in its own box (reading.css). This marks the boxes that do, so that the stylesheet can
// say so above them: a reader who does not swipe would miss the right-hand columns or the end of
// a line of code (the book's code is up to 80 columns wide, a phone shows about 45).
(function () {
  "use strict";
  var WIDE = "wide-box";
  function wider(el) {
    return el.scrollWidth > el.clientWidth + 1;
  }
  function mark() {
    var boxes = document.querySelectorAll(
      ".bd-article .cell_output, .bd-article .pst-scrollable-table-container");
    boxes.forEach(function (box) {
      // (an HTML table printed by a cell scrolls in its .output box, not in the table)
      var inner = box.querySelectorAll("pre, table, .output");
      var wide = wider(box) || Array.prototype.some.call(inner, wider);
      box.classList.toggle(WIDE, wide && !box.querySelector("img"));
    });
    // code: a cell's source (shown when its folded cell is opened) or a code block of the text
    document.querySelectorAll(".bd-article div.highlight").forEach(function (box) {
      if (box.closest(".cell_output")) return;
      var pre = box.querySelector("pre");
      box.classList.toggle(WIDE, !!pre && wider(pre));
    });
  }
  window.addEventListener("load", mark);
  window.addEventListener("resize", mark);
  // a folded cell's source has no width until it is opened
  document.addEventListener("toggle", mark, true);
})();
