"""What test modules share: helpers, documents, runs and marks, imported as
`from support.<module> import ...` (tests/ is on sys.path), never from another test module,
so that no test module runs another's module-level code or collects its tests twice."""
