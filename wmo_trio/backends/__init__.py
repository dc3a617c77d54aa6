"""Where an episode's loop runs.

- `local`: in this process (`wmo_trio.episode.runtime.EpisodeRuntime` for the built-in
  loop, `wmo_trio.episode.code_runtime.CodeRuntime` for a `code:runtime` document).
- `e2b`: in an E2B sandbox (`wmo_trio.backends.e2b.E2BRuntime`), the host answering model
  and tool calls.

`wmo_trio.backends.runner` is the portable half both share: the kit and the sandbox
runner, standard library only. `wmo_trio.episode.build.build_runtime` chooses among them.
Nothing is imported here, so the local backend never loads the e2b SDK.
"""
