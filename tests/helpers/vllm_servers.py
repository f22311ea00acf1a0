"""The vLLM server processes the fault tests kill (tests/runners/test_faults.py, tests/trainer/test_async_faults.py)."""


def server_pid(url: str) -> int:
    import psutil

    port = url.rsplit(":", 1)[1]
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if "vllm.entrypoints.openai.api_server" in cmdline and port in cmdline:
            return process.pid
    raise LookupError(f"no vLLM server process for {url}")
