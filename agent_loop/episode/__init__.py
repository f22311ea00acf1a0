"""One episode: the loop (:mod:`.loop`) and its options (:mod:`.config`), chat formatting token-in,
token-out (:mod:`.chat`), the tool-call formats (:mod:`.tool_formats`) and their parsers (:mod:`.parsers`),
and tools (:mod:`.tools`). docs/design.md sections 4-5."""
