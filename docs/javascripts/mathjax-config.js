// MathJax 3 configuration for pymdownx.arithmatex (generic mode) and mkdocs-jupyter notebooks.
//
// arithmatex wraps math in <span class="arithmatex">\(...\)</span> and
// <div class="arithmatex">\[...\]</div>. Notebook markdown rendered by mkdocs-jupyter keeps its
// $...$ and $$...$$ as plain text inside .jp-RenderedMarkdown, so those delimiters are accepted
// too, but only inside these two containers: typesetMath() hands MathJax just those elements,
// so the rest of the page (prose with a literal $, code) is never scanned.
//
// Automatic typesetting is off. Once MathJax is ready, typesetMath() runs on the current page
// and, with Material for MkDocs, after every page change of its instant navigation: document$
// replays the last page to late subscribers, so subscribing from MathJax's ready hook is safe.
window.MathJax = {
  tex: {
    inlineMath: [["\\(", "\\)"], ["$", "$"]],
    displayMath: [["\\[", "\\]"], ["$$", "$$"]],
    processEscapes: true,
    processEnvironments: true,
  },
  svg: {
    fontCache: "global",
  },
  startup: {
    typeset: false,
    ready() {
      MathJax.startup.defaultReady();
      MathJax.startup.promise.then(() => {
        if (typeof document$ !== "undefined") {
          document$.subscribe(typesetMath);
        } else {
          typesetMath();
        }
      });
    },
  },
};

function typesetMath() {
  const roots = Array.from(document.querySelectorAll(".arithmatex, .jp-RenderedMarkdown"));
  if (roots.length === 0) {
    return;
  }
  const output = MathJax.startup.output;
  // Drop state from the previous page (instant navigation): SVG keeps a global font cache.
  if (typeof output.clearFontCache === "function") {
    output.clearFontCache();
  } else if (typeof output.clearCache === "function") {
    output.clearCache();
  }
  MathJax.typesetClear();
  MathJax.texReset();
  MathJax.typesetPromise(roots).catch((err) => console.error("MathJax typeset failed:", err));
}
