import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TestStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NO_STATUS: _ClassVar[TestStatus]
    PASSED: _ClassVar[TestStatus]
    FLAKY: _ClassVar[TestStatus]
    TIMEOUT: _ClassVar[TestStatus]
    FAILED: _ClassVar[TestStatus]
    INCOMPLETE: _ClassVar[TestStatus]
    REMOTE_FAILURE: _ClassVar[TestStatus]
    FAILED_TO_BUILD: _ClassVar[TestStatus]
    TOOL_HALTED_BEFORE_TESTING: _ClassVar[TestStatus]
NO_STATUS: TestStatus
PASSED: TestStatus
FLAKY: TestStatus
TIMEOUT: TestStatus
FAILED: TestStatus
INCOMPLETE: TestStatus
REMOTE_FAILURE: TestStatus
FAILED_TO_BUILD: TestStatus
TOOL_HALTED_BEFORE_TESTING: TestStatus

class BuildEventId(_message.Message):
    __slots__ = ("unknown", "progress", "started", "unstructured_command_line", "options_parsed", "configuration", "pattern", "pattern_skipped", "target_completed", "action_completed", "test_result", "test_summary", "build_finished")
    class UnknownBuildEventId(_message.Message):
        __slots__ = ("details",)
        DETAILS_FIELD_NUMBER: _ClassVar[int]
        details: str
        def __init__(self, details: _Optional[str] = ...) -> None: ...
    class ProgressId(_message.Message):
        __slots__ = ("opaque_count",)
        OPAQUE_COUNT_FIELD_NUMBER: _ClassVar[int]
        opaque_count: int
        def __init__(self, opaque_count: _Optional[int] = ...) -> None: ...
    class BuildStartedId(_message.Message):
        __slots__ = ()
        def __init__(self) -> None: ...
    class UnstructuredCommandLineId(_message.Message):
        __slots__ = ()
        def __init__(self) -> None: ...
    class OptionsParsedId(_message.Message):
        __slots__ = ()
        def __init__(self) -> None: ...
    class PatternExpandedId(_message.Message):
        __slots__ = ("pattern",)
        PATTERN_FIELD_NUMBER: _ClassVar[int]
        pattern: _containers.RepeatedScalarFieldContainer[str]
        def __init__(self, pattern: _Optional[_Iterable[str]] = ...) -> None: ...
    class ConfigurationId(_message.Message):
        __slots__ = ("id",)
        ID_FIELD_NUMBER: _ClassVar[int]
        id: str
        def __init__(self, id: _Optional[str] = ...) -> None: ...
    class TargetCompletedId(_message.Message):
        __slots__ = ("label", "configuration", "aspect")
        LABEL_FIELD_NUMBER: _ClassVar[int]
        CONFIGURATION_FIELD_NUMBER: _ClassVar[int]
        ASPECT_FIELD_NUMBER: _ClassVar[int]
        label: str
        configuration: BuildEventId.ConfigurationId
        aspect: str
        def __init__(self, label: _Optional[str] = ..., configuration: _Optional[_Union[BuildEventId.ConfigurationId, _Mapping]] = ..., aspect: _Optional[str] = ...) -> None: ...
    class ActionCompletedId(_message.Message):
        __slots__ = ("primary_output", "label", "configuration")
        PRIMARY_OUTPUT_FIELD_NUMBER: _ClassVar[int]
        LABEL_FIELD_NUMBER: _ClassVar[int]
        CONFIGURATION_FIELD_NUMBER: _ClassVar[int]
        primary_output: str
        label: str
        configuration: BuildEventId.ConfigurationId
        def __init__(self, primary_output: _Optional[str] = ..., label: _Optional[str] = ..., configuration: _Optional[_Union[BuildEventId.ConfigurationId, _Mapping]] = ...) -> None: ...
    class TestResultId(_message.Message):
        __slots__ = ("label", "configuration", "run", "shard", "attempt")
        LABEL_FIELD_NUMBER: _ClassVar[int]
        CONFIGURATION_FIELD_NUMBER: _ClassVar[int]
        RUN_FIELD_NUMBER: _ClassVar[int]
        SHARD_FIELD_NUMBER: _ClassVar[int]
        ATTEMPT_FIELD_NUMBER: _ClassVar[int]
        label: str
        configuration: BuildEventId.ConfigurationId
        run: int
        shard: int
        attempt: int
        def __init__(self, label: _Optional[str] = ..., configuration: _Optional[_Union[BuildEventId.ConfigurationId, _Mapping]] = ..., run: _Optional[int] = ..., shard: _Optional[int] = ..., attempt: _Optional[int] = ...) -> None: ...
    class TestSummaryId(_message.Message):
        __slots__ = ("label", "configuration")
        LABEL_FIELD_NUMBER: _ClassVar[int]
        CONFIGURATION_FIELD_NUMBER: _ClassVar[int]
        label: str
        configuration: BuildEventId.ConfigurationId
        def __init__(self, label: _Optional[str] = ..., configuration: _Optional[_Union[BuildEventId.ConfigurationId, _Mapping]] = ...) -> None: ...
    class BuildFinishedId(_message.Message):
        __slots__ = ()
        def __init__(self) -> None: ...
    UNKNOWN_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    UNSTRUCTURED_COMMAND_LINE_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_PARSED_FIELD_NUMBER: _ClassVar[int]
    CONFIGURATION_FIELD_NUMBER: _ClassVar[int]
    PATTERN_FIELD_NUMBER: _ClassVar[int]
    PATTERN_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    TARGET_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    ACTION_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    TEST_RESULT_FIELD_NUMBER: _ClassVar[int]
    TEST_SUMMARY_FIELD_NUMBER: _ClassVar[int]
    BUILD_FINISHED_FIELD_NUMBER: _ClassVar[int]
    unknown: BuildEventId.UnknownBuildEventId
    progress: BuildEventId.ProgressId
    started: BuildEventId.BuildStartedId
    unstructured_command_line: BuildEventId.UnstructuredCommandLineId
    options_parsed: BuildEventId.OptionsParsedId
    configuration: BuildEventId.ConfigurationId
    pattern: BuildEventId.PatternExpandedId
    pattern_skipped: BuildEventId.PatternExpandedId
    target_completed: BuildEventId.TargetCompletedId
    action_completed: BuildEventId.ActionCompletedId
    test_result: BuildEventId.TestResultId
    test_summary: BuildEventId.TestSummaryId
    build_finished: BuildEventId.BuildFinishedId
    def __init__(self, unknown: _Optional[_Union[BuildEventId.UnknownBuildEventId, _Mapping]] = ..., progress: _Optional[_Union[BuildEventId.ProgressId, _Mapping]] = ..., started: _Optional[_Union[BuildEventId.BuildStartedId, _Mapping]] = ..., unstructured_command_line: _Optional[_Union[BuildEventId.UnstructuredCommandLineId, _Mapping]] = ..., options_parsed: _Optional[_Union[BuildEventId.OptionsParsedId, _Mapping]] = ..., configuration: _Optional[_Union[BuildEventId.ConfigurationId, _Mapping]] = ..., pattern: _Optional[_Union[BuildEventId.PatternExpandedId, _Mapping]] = ..., pattern_skipped: _Optional[_Union[BuildEventId.PatternExpandedId, _Mapping]] = ..., target_completed: _Optional[_Union[BuildEventId.TargetCompletedId, _Mapping]] = ..., action_completed: _Optional[_Union[BuildEventId.ActionCompletedId, _Mapping]] = ..., test_result: _Optional[_Union[BuildEventId.TestResultId, _Mapping]] = ..., test_summary: _Optional[_Union[BuildEventId.TestSummaryId, _Mapping]] = ..., build_finished: _Optional[_Union[BuildEventId.BuildFinishedId, _Mapping]] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("stdout", "stderr")
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    stdout: str
    stderr: str
    def __init__(self, stdout: _Optional[str] = ..., stderr: _Optional[str] = ...) -> None: ...

class Aborted(_message.Message):
    __slots__ = ("reason", "description")
    class AbortReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        UNKNOWN: _ClassVar[Aborted.AbortReason]
        USER_INTERRUPTED: _ClassVar[Aborted.AbortReason]
        NO_ANALYZE: _ClassVar[Aborted.AbortReason]
        NO_BUILD: _ClassVar[Aborted.AbortReason]
        TIME_OUT: _ClassVar[Aborted.AbortReason]
        REMOTE_ENVIRONMENT_FAILURE: _ClassVar[Aborted.AbortReason]
        INTERNAL: _ClassVar[Aborted.AbortReason]
        LOADING_FAILURE: _ClassVar[Aborted.AbortReason]
        ANALYSIS_FAILURE: _ClassVar[Aborted.AbortReason]
        SKIPPED: _ClassVar[Aborted.AbortReason]
        INCOMPLETE: _ClassVar[Aborted.AbortReason]
        OUT_OF_MEMORY: _ClassVar[Aborted.AbortReason]
    UNKNOWN: Aborted.AbortReason
    USER_INTERRUPTED: Aborted.AbortReason
    NO_ANALYZE: Aborted.AbortReason
    NO_BUILD: Aborted.AbortReason
    TIME_OUT: Aborted.AbortReason
    REMOTE_ENVIRONMENT_FAILURE: Aborted.AbortReason
    INTERNAL: Aborted.AbortReason
    LOADING_FAILURE: Aborted.AbortReason
    ANALYSIS_FAILURE: Aborted.AbortReason
    SKIPPED: Aborted.AbortReason
    INCOMPLETE: Aborted.AbortReason
    OUT_OF_MEMORY: Aborted.AbortReason
    REASON_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    reason: Aborted.AbortReason
    description: str
    def __init__(self, reason: _Optional[_Union[Aborted.AbortReason, str]] = ..., description: _Optional[str] = ...) -> None: ...

class BuildStarted(_message.Message):
    __slots__ = ("uuid", "start_time_millis", "start_time", "build_tool_version", "options_description", "command", "working_directory", "workspace_directory", "server_pid")
    UUID_FIELD_NUMBER: _ClassVar[int]
    START_TIME_MILLIS_FIELD_NUMBER: _ClassVar[int]
    START_TIME_FIELD_NUMBER: _ClassVar[int]
    BUILD_TOOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    WORKING_DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    WORKSPACE_DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    SERVER_PID_FIELD_NUMBER: _ClassVar[int]
    uuid: str
    start_time_millis: int
    start_time: _timestamp_pb2.Timestamp
    build_tool_version: str
    options_description: str
    command: str
    working_directory: str
    workspace_directory: str
    server_pid: int
    def __init__(self, uuid: _Optional[str] = ..., start_time_millis: _Optional[int] = ..., start_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., build_tool_version: _Optional[str] = ..., options_description: _Optional[str] = ..., command: _Optional[str] = ..., working_directory: _Optional[str] = ..., workspace_directory: _Optional[str] = ..., server_pid: _Optional[int] = ...) -> None: ...

class UnstructuredCommandLine(_message.Message):
    __slots__ = ("args",)
    ARGS_FIELD_NUMBER: _ClassVar[int]
    args: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, args: _Optional[_Iterable[str]] = ...) -> None: ...

class OptionsParsed(_message.Message):
    __slots__ = ("startup_options", "explicit_startup_options", "cmd_line", "explicit_cmd_line", "tool_tag")
    STARTUP_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    EXPLICIT_STARTUP_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    CMD_LINE_FIELD_NUMBER: _ClassVar[int]
    EXPLICIT_CMD_LINE_FIELD_NUMBER: _ClassVar[int]
    TOOL_TAG_FIELD_NUMBER: _ClassVar[int]
    startup_options: _containers.RepeatedScalarFieldContainer[str]
    explicit_startup_options: _containers.RepeatedScalarFieldContainer[str]
    cmd_line: _containers.RepeatedScalarFieldContainer[str]
    explicit_cmd_line: _containers.RepeatedScalarFieldContainer[str]
    tool_tag: str
    def __init__(self, startup_options: _Optional[_Iterable[str]] = ..., explicit_startup_options: _Optional[_Iterable[str]] = ..., cmd_line: _Optional[_Iterable[str]] = ..., explicit_cmd_line: _Optional[_Iterable[str]] = ..., tool_tag: _Optional[str] = ...) -> None: ...

class PatternExpanded(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class File(_message.Message):
    __slots__ = ("path_prefix", "name", "uri", "contents", "symlink_target_path", "digest", "length")
    PATH_PREFIX_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    URI_FIELD_NUMBER: _ClassVar[int]
    CONTENTS_FIELD_NUMBER: _ClassVar[int]
    SYMLINK_TARGET_PATH_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    path_prefix: _containers.RepeatedScalarFieldContainer[str]
    name: str
    uri: str
    contents: bytes
    symlink_target_path: str
    digest: str
    length: int
    def __init__(self, path_prefix: _Optional[_Iterable[str]] = ..., name: _Optional[str] = ..., uri: _Optional[str] = ..., contents: _Optional[bytes] = ..., symlink_target_path: _Optional[str] = ..., digest: _Optional[str] = ..., length: _Optional[int] = ...) -> None: ...

class ActionExecuted(_message.Message):
    __slots__ = ("success", "type", "exit_code", "stdout", "stderr", "label", "primary_output", "command_line")
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    COMMAND_LINE_FIELD_NUMBER: _ClassVar[int]
    success: bool
    type: str
    exit_code: int
    stdout: File
    stderr: File
    label: str
    primary_output: File
    command_line: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, success: _Optional[bool] = ..., type: _Optional[str] = ..., exit_code: _Optional[int] = ..., stdout: _Optional[_Union[File, _Mapping]] = ..., stderr: _Optional[_Union[File, _Mapping]] = ..., label: _Optional[str] = ..., primary_output: _Optional[_Union[File, _Mapping]] = ..., command_line: _Optional[_Iterable[str]] = ...) -> None: ...

class TargetComplete(_message.Message):
    __slots__ = ("success", "tag")
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    success: bool
    tag: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, success: _Optional[bool] = ..., tag: _Optional[_Iterable[str]] = ...) -> None: ...

class TestResult(_message.Message):
    __slots__ = ("status", "status_details", "cached_locally", "test_attempt_duration_millis", "test_action_output", "execution_info")
    class ExecutionInfo(_message.Message):
        __slots__ = ("strategy", "cached_remotely", "exit_code", "hostname")
        STRATEGY_FIELD_NUMBER: _ClassVar[int]
        CACHED_REMOTELY_FIELD_NUMBER: _ClassVar[int]
        EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
        HOSTNAME_FIELD_NUMBER: _ClassVar[int]
        strategy: str
        cached_remotely: bool
        exit_code: int
        hostname: str
        def __init__(self, strategy: _Optional[str] = ..., cached_remotely: _Optional[bool] = ..., exit_code: _Optional[int] = ..., hostname: _Optional[str] = ...) -> None: ...
    STATUS_FIELD_NUMBER: _ClassVar[int]
    STATUS_DETAILS_FIELD_NUMBER: _ClassVar[int]
    CACHED_LOCALLY_FIELD_NUMBER: _ClassVar[int]
    TEST_ATTEMPT_DURATION_MILLIS_FIELD_NUMBER: _ClassVar[int]
    TEST_ACTION_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_INFO_FIELD_NUMBER: _ClassVar[int]
    status: TestStatus
    status_details: str
    cached_locally: bool
    test_attempt_duration_millis: int
    test_action_output: _containers.RepeatedCompositeFieldContainer[File]
    execution_info: TestResult.ExecutionInfo
    def __init__(self, status: _Optional[_Union[TestStatus, str]] = ..., status_details: _Optional[str] = ..., cached_locally: _Optional[bool] = ..., test_attempt_duration_millis: _Optional[int] = ..., test_action_output: _Optional[_Iterable[_Union[File, _Mapping]]] = ..., execution_info: _Optional[_Union[TestResult.ExecutionInfo, _Mapping]] = ...) -> None: ...

class TestSummary(_message.Message):
    __slots__ = ("overall_status", "total_run_count", "passed", "failed")
    OVERALL_STATUS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_RUN_COUNT_FIELD_NUMBER: _ClassVar[int]
    PASSED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    overall_status: TestStatus
    total_run_count: int
    passed: _containers.RepeatedCompositeFieldContainer[File]
    failed: _containers.RepeatedCompositeFieldContainer[File]
    def __init__(self, overall_status: _Optional[_Union[TestStatus, str]] = ..., total_run_count: _Optional[int] = ..., passed: _Optional[_Iterable[_Union[File, _Mapping]]] = ..., failed: _Optional[_Iterable[_Union[File, _Mapping]]] = ...) -> None: ...

class BuildFinished(_message.Message):
    __slots__ = ("overall_success", "exit_code", "finish_time_millis", "finish_time")
    class ExitCode(_message.Message):
        __slots__ = ("name", "code")
        NAME_FIELD_NUMBER: _ClassVar[int]
        CODE_FIELD_NUMBER: _ClassVar[int]
        name: str
        code: int
        def __init__(self, name: _Optional[str] = ..., code: _Optional[int] = ...) -> None: ...
    OVERALL_SUCCESS_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    FINISH_TIME_MILLIS_FIELD_NUMBER: _ClassVar[int]
    FINISH_TIME_FIELD_NUMBER: _ClassVar[int]
    overall_success: bool
    exit_code: BuildFinished.ExitCode
    finish_time_millis: int
    finish_time: _timestamp_pb2.Timestamp
    def __init__(self, overall_success: _Optional[bool] = ..., exit_code: _Optional[_Union[BuildFinished.ExitCode, _Mapping]] = ..., finish_time_millis: _Optional[int] = ..., finish_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class BuildEvent(_message.Message):
    __slots__ = ("id", "children", "last_message", "progress", "aborted", "started", "unstructured_command_line", "options_parsed", "expanded", "action", "completed", "test_result", "test_summary", "finished")
    ID_FIELD_NUMBER: _ClassVar[int]
    CHILDREN_FIELD_NUMBER: _ClassVar[int]
    LAST_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    UNSTRUCTURED_COMMAND_LINE_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_PARSED_FIELD_NUMBER: _ClassVar[int]
    EXPANDED_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    TEST_RESULT_FIELD_NUMBER: _ClassVar[int]
    TEST_SUMMARY_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    id: BuildEventId
    children: _containers.RepeatedCompositeFieldContainer[BuildEventId]
    last_message: bool
    progress: Progress
    aborted: Aborted
    started: BuildStarted
    unstructured_command_line: UnstructuredCommandLine
    options_parsed: OptionsParsed
    expanded: PatternExpanded
    action: ActionExecuted
    completed: TargetComplete
    test_result: TestResult
    test_summary: TestSummary
    finished: BuildFinished
    def __init__(self, id: _Optional[_Union[BuildEventId, _Mapping]] = ..., children: _Optional[_Iterable[_Union[BuildEventId, _Mapping]]] = ..., last_message: _Optional[bool] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ..., aborted: _Optional[_Union[Aborted, _Mapping]] = ..., started: _Optional[_Union[BuildStarted, _Mapping]] = ..., unstructured_command_line: _Optional[_Union[UnstructuredCommandLine, _Mapping]] = ..., options_parsed: _Optional[_Union[OptionsParsed, _Mapping]] = ..., expanded: _Optional[_Union[PatternExpanded, _Mapping]] = ..., action: _Optional[_Union[ActionExecuted, _Mapping]] = ..., completed: _Optional[_Union[TargetComplete, _Mapping]] = ..., test_result: _Optional[_Union[TestResult, _Mapping]] = ..., test_summary: _Optional[_Union[TestSummary, _Mapping]] = ..., finished: _Optional[_Union[BuildFinished, _Mapping]] = ...) -> None: ...
