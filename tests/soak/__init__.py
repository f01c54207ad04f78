"""The soak test: a bounded mixed load against a running pdserve, then proof that nothing leaked
(``python -m tests.soak.run``). A package, so that its modules (``client``, ``requests``, ...)
never shadow libraries of the same name on a test's import path."""
