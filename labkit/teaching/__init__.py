"""The book's side of labkit: what the notebooks teach with, on top of everything else.

Nothing outside this package imports it (``tests/test_architecture.py``).

* ``exercises``: the checkers (``Exercises``: ``check``, ``check_function``, ``check_behaviour``, ``quiz``);
* ``guards``: what keeps a checker honest (fresh hidden cases, copies, counted calls, a watch on calls);
* ``build_it``: the hidden cases of the build-it exercises, judged against labkit's own pieces;
* ``answers``, ``quizzes``: the expected values of the value exercises; each chapter's quiz;
* ``excerpts``: the lines of labkit a chapter prints; ``diagrams``: the roadmap and the article's figures;
* ``results``: a benchmark's committed results, found from a notebook (``committed_result``);
* ``widgets``: the interactive figures, one module per chapter.
"""
