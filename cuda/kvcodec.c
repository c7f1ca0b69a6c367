/* kvcodec.c — placeholder while the report is being written (helper H-A). */
#include <stdio.h>

int main(void)
{
    fputs("kvcodec: not implemented yet\n", stderr);
    return 1;
}
