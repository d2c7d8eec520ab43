// On a phone, a printed output or a table wider than the text column scrolls sideways in its
// own box (reading.css). This marks the boxes that do, so that the stylesheet can say so above
// them: a reader who does not swipe would miss the right-hand columns.
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
      var inner = box.querySelectorAll("pre, table");
      var wide = wider(box) || Array.prototype.some.call(inner, wider);
      box.classList.toggle(WIDE, wide && !box.querySelector("img"));
    });
  }
  window.addEventListener("load", mark);
  window.addEventListener("resize", mark);
})();
