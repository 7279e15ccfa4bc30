// Loaded by myst-nb between require.js and embed-amd.js on pages with widgets
// (see book/_ext/offline_assets.py). Two fixes for a book served offline:
(function () {
  // 1. embed-amd.js fetches its icon fonts from beside its AMD module URL,
  //    which otherwise resolves against the page's folder (404s). Point the
  //    module at _static/vendor/, where scripts/fetch_assets.py put the fonts.
  var vendor = new URL("vendor", document.currentScript.src).href;
  require.config({paths: {"@jupyter-widgets/html-manager/dist": vendor}});

  // 2. ipywidgets typesets labels with MathJax 2's MathJax.Hub.Queue; the
  //    book loads MathJax 3, which has no Hub, so each label threw a
  //    TypeError. MathJax 3 (deferred) has replaced window.MathJax by
  //    DOMContentLoaded, and widgets render later, on window load.
  window.addEventListener("DOMContentLoaded", function () {
    var mj = window.MathJax;
    if (!mj || mj.Hub || !mj.startup) return;
    mj.Hub = {Queue: function (job) {  // job: ["Typeset", Hub, element]
      return mj.startup.promise.then(function () {
        return mj.typesetPromise([job[2]]);
      });
    }};
  });
})();
