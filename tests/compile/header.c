/* header.c — one header as its own translation unit, implementation included: tests/compile/matrix.sh
 * builds it once per header, compiler, language and mode, and as the implementation half of the link
 * test. MATRIX_HEADER names the header; the implementation macros come on the command line. It is
 * included twice: the declarations are guarded and the implementation must come out once. */
#include MATRIX_HEADER
#include MATRIX_HEADER
