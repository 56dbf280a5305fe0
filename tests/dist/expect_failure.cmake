# Runs COMMAND ("|"-separated) and passes when it exits non-zero and its output matches EXPECT
# (a regular expression); used by the fault tests, whose success is a clean failure.
string(REPLACE "|" ";" command "${COMMAND}")
execute_process(COMMAND ${command} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}${err}")
if(rc EQUAL 0)
  message(FATAL_ERROR "the job exited 0; expected every rank to fail")
endif()
if(NOT "${out}${err}" MATCHES "${EXPECT}")
  message(FATAL_ERROR "exit code ${rc} but no message matching '${EXPECT}'")
endif()
message("job failed as expected (exit code ${rc})")
