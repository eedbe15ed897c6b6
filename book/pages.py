"""The files the book renders, as patterns of paths in the repository (Sphinx's ``include_patterns``; the
book's tests read them too). Every committed notebook and Markdown file is one: the tests check that."""

PAGES = ["book/index.md", "README.md", "notebooks/README.md",
         "notebooks/[0-9][0-9]_*.ipynb", "notebooks/labs/[0-9][0-9]_*.ipynb",
         "course/README.md", "course/GUIDE.md", "course/*/sheet.md",
         "nanollm/README.md", "methods/README.md", "methods/claims.md", "experiments/README.md",
         "experiments/evaluation/*.md",
         "methods/tensor_attention/README.md", "kernels/README.md", "kernels/inside.md", "fastpath/README.md",
         "fastpath/inside.md", "nanollm/inside.md", "results/README.md",
         "nanollm/checkpoints/*/README.md", "methods/tensor_attention/checkpoints/*/README.md"]
