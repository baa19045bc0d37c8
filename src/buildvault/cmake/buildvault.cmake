# buildvault.cmake: run custom build steps through the buildvault cache (`buildvault run`).
#
#   execute_process(COMMAND buildvault cmake-module-path OUTPUT_VARIABLE dir OUTPUT_STRIP_TRAILING_WHITESPACE)
#   list(APPEND CMAKE_MODULE_PATH ${dir})
#   include(buildvault)
#
#   buildvault_cached_command(cmd
#     NAME my_op                          # status line / event log name
#     INPUTS ${src_dir} ${header}         # files or directories (walked, EXCLUDES left out)
#     EXCLUDES ".git" "*.log"             # replaces the defaults
#     RECIPE_FILES ${script}              # the recipe: script, options files
#     RECIPE_VALUES "-O2" "mode=fast"     # recipe values joining the key
#     ENV SOC=ascend910b1                 # set for the command and part of the key
#     TOOLS ascendc cmake                 # each tool's --version output joins the key
#     TOOLCHAIN_FILES ${CANN}/version.info
#     PLATFORM soc=ascend910b1 cann=8.0.RC3
#     NORMALIZE_ROOTS /opt/vendor         # more roots (the source and build roots always are)
#     WORKDIR ${CMAKE_CURRENT_BINARY_DIR}
#     OUTPUTS ${out1} ${out_dir}          # or OUTPUT_DIR dir: what the command creates/changes there
#     COMMAND sh ${script} ${src_dir} ${out_dir})
#   add_custom_command(OUTPUT ${out1} ${out_dir}/x COMMAND ${cmd} DEPENDS ... VERBATIM)
#
#   buildvault_fetch(protobuf_src                # sets protobuf_src_FILE (and _SOURCE_DIR with EXTRACT_TO)
#     URL https://github.com/.../protobuf-3.21.12.tar.gz [URL mirror...]
#     SHA256 <64 hex digits>
#     [DESTINATION ${CMAKE_BINARY_DIR}/_deps/protobuf.tar.gz]
#     [EXTRACT_TO ${CMAKE_BINARY_DIR}/_deps/protobuf])
#
# buildvault_fetch downloads at configure time through the cache's Remote Asset API
# (`buildvault asset fetch`): from the cache when any server sharing it fetched it before, else
# the server downloads and verifies it. A miss or a checksum mismatch stops the configure with
# the reason. A file already in place with the right SHA-256 is not fetched again.
#
# Give WORKING_DIRECTORY = WORKDIR to add_custom_command. The cache is found the way
# buildvault-cc finds it: BUILDVAULT_REMOTE, BUILDVAULT_WRITER, BUILDVAULT_INSTANCE, ... in the
# build's environment. With BUILDVAULT_CACHED_STEPS OFF the command runs plainly (with ENV set).

option(BUILDVAULT_CACHED_STEPS "run buildvault_cached_command steps through `buildvault run`" ON)
find_program(BUILDVAULT_EXECUTABLE NAMES buildvault DOC "the buildvault command")
# Steps start `buildvault run` as buildvault-run-fast (python -IS: no site-packages start-up,
# about a third of a cache hit's time), written into the build tree at configure time.
if(BUILDVAULT_CACHED_STEPS AND BUILDVAULT_EXECUTABLE)
  execute_process(COMMAND ${BUILDVAULT_EXECUTABLE} run --install-fast ${CMAKE_BINARY_DIR}/buildvault
                  OUTPUT_VARIABLE BUILDVAULT_RUN_FAST OUTPUT_STRIP_TRAILING_WHITESPACE
                  RESULT_VARIABLE _buildvault_fast_result)
  if(NOT _buildvault_fast_result EQUAL 0)
    set(BUILDVAULT_RUN_FAST "")
  endif()
endif()

function(buildvault_cached_command out_var)
  set(multi INPUTS EXCLUDES RECIPE_FILES RECIPE_VALUES ENV TOOLS TOOLCHAIN_FILES PLATFORM NORMALIZE_ROOTS OUTPUTS
      COMMAND)
  cmake_parse_arguments(PARSE_ARGV 1 BV "" "NAME;WORKDIR;OUTPUT_DIR" "${multi}")
  if(BV_UNPARSED_ARGUMENTS)
    message(FATAL_ERROR "buildvault_cached_command: unknown arguments: ${BV_UNPARSED_ARGUMENTS}")
  endif()
  if(NOT BV_COMMAND)
    message(FATAL_ERROR "buildvault_cached_command: COMMAND is required")
  endif()
  if(NOT BV_OUTPUTS AND NOT BV_OUTPUT_DIR)
    message(FATAL_ERROR "buildvault_cached_command: give OUTPUTS or OUTPUT_DIR")
  endif()
  if(NOT BUILDVAULT_CACHED_STEPS)
    if(BV_ENV)
      set(${out_var} ${CMAKE_COMMAND} -E env ${BV_ENV} ${BV_COMMAND} PARENT_SCOPE)
    else()
      set(${out_var} ${BV_COMMAND} PARENT_SCOPE)
    endif()
    return()
  endif()
  if(NOT BUILDVAULT_EXECUTABLE)
    message(FATAL_ERROR "buildvault_cached_command: buildvault not found (set BUILDVAULT_EXECUTABLE)")
  endif()
  if(BUILDVAULT_RUN_FAST)
    set(cmd ${BUILDVAULT_RUN_FAST})
  else()
    set(cmd ${BUILDVAULT_EXECUTABLE} run)
  endif()
  if(BV_NAME)
    list(APPEND cmd "--name=${BV_NAME}")
  endif()
  if(BV_WORKDIR)
    list(APPEND cmd "--workdir=${BV_WORKDIR}")
  endif()
  if(BV_OUTPUT_DIR)
    list(APPEND cmd "--output-dir=${BV_OUTPUT_DIR}")
  endif()
  # --option=value: a value that starts with '-' stays a value.
  foreach(pair INPUTS:input EXCLUDES:exclude RECIPE_FILES:recipe-file RECIPE_VALUES:recipe-value ENV:env
          TOOLS:tool TOOLCHAIN_FILES:toolchain-file PLATFORM:platform NORMALIZE_ROOTS:normalize-root
          OUTPUTS:output)
    string(REPLACE ":" ";" parts "${pair}")
    list(GET parts 0 keyword)
    list(GET parts 1 flag)
    foreach(value IN LISTS BV_${keyword})
      list(APPEND cmd "--${flag}=${value}")
    endforeach()
  endforeach()
  list(APPEND cmd -- ${BV_COMMAND})
  set(${out_var} ${cmd} PARENT_SCOPE)
endfunction()

function(buildvault_fetch name)
  cmake_parse_arguments(PARSE_ARGV 1 BVF "" "SHA256;DESTINATION;EXTRACT_TO" "URL")
  if(BVF_UNPARSED_ARGUMENTS)
    message(FATAL_ERROR "buildvault_fetch(${name}): unknown arguments: ${BVF_UNPARSED_ARGUMENTS}")
  endif()
  if(NOT BVF_URL OR NOT BVF_SHA256)
    message(FATAL_ERROR "buildvault_fetch(${name}): give URL and SHA256")
  endif()
  if(NOT BUILDVAULT_EXECUTABLE)
    message(FATAL_ERROR "buildvault_fetch(${name}): buildvault not found (set BUILDVAULT_EXECUTABLE)")
  endif()
  list(GET BVF_URL 0 first_url)
  string(REGEX REPLACE "[?#].*$" "" first_path "${first_url}")
  get_filename_component(file_name "${first_path}" NAME)
  if(BVF_DESTINATION)
    set(dest "${BVF_DESTINATION}")
  else()
    set(dest "${CMAKE_BINARY_DIR}/_buildvault_fetch/${name}/${file_name}")
  endif()
  string(TOLOWER "${BVF_SHA256}" wanted)
  set(have "")
  if(EXISTS "${dest}")
    file(SHA256 "${dest}" have)
  endif()
  if(NOT have STREQUAL wanted)
    execute_process(COMMAND ${BUILDVAULT_EXECUTABLE} asset fetch ${BVF_URL} --sha256 ${wanted} -o ${dest}
                    RESULT_VARIABLE result OUTPUT_QUIET ERROR_VARIABLE error ERROR_STRIP_TRAILING_WHITESPACE)
    if(NOT result EQUAL 0)
      message(FATAL_ERROR "buildvault_fetch(${name}): ${error}")
    endif()
  endif()
  set(${name}_FILE "${dest}" PARENT_SCOPE)
  if(BVF_EXTRACT_TO)
    set(stamp "${BVF_EXTRACT_TO}.buildvault-sha256")  # beside it: the directory holds the archive alone
    set(extracted "")
    if(EXISTS "${stamp}")
      file(READ "${stamp}" extracted)
    endif()
    if(NOT extracted STREQUAL wanted)
      file(REMOVE_RECURSE "${BVF_EXTRACT_TO}")
      file(ARCHIVE_EXTRACT INPUT "${dest}" DESTINATION "${BVF_EXTRACT_TO}")
      file(WRITE "${stamp}" "${wanted}")
    endif()
    # An archive with one top-level directory (name-1.0/...): that directory is the source.
    file(GLOB entries LIST_DIRECTORIES true "${BVF_EXTRACT_TO}/*")
    list(LENGTH entries count)
    if(count EQUAL 1 AND IS_DIRECTORY "${entries}")
      set(${name}_SOURCE_DIR "${entries}" PARENT_SCOPE)
    else()
      set(${name}_SOURCE_DIR "${BVF_EXTRACT_TO}" PARENT_SCOPE)
    endif()
  endif()
endfunction()
