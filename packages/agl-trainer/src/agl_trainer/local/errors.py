"""Exceptions of the local stack; each message names what failed, the value and the fix."""


class LocalStackError(RuntimeError):
    """Base class of every failure of the local (no-argument) training stack."""


class ProvisionError(LocalStackError):
    """A tool environment (agl-server or vLLM) could not be created or is broken."""


class ProcessStartError(LocalStackError):
    """A child server exited or did not become healthy in time; the message holds its log tail."""


class ServerApiError(LocalStackError):
    """agl-server answered a request of the local runner with an unexpected status."""


class AgentImportError(LocalStackError):
    """``agentlightning.local.agent_class`` cannot be imported by agl-controller's interpreter."""


class ProcessDiedError(LocalStackError):
    """A process of the local stack died during the run (or agl-controller more often than allowed)."""
